"""`pdpush bench --scenario goodput` runs the real daemons and verifies every byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


_KILLED_BENCH = """
import multiprocessing as mp
import sys
import time

from pdpush_tools.bench.common import child

if __name__ == "__main__":
    procs = [mp.get_context("spawn").Process(target=child, args=(time.sleep, 600)) for _ in range(2)]
    for p in procs:
        p.start()
    print(" ".join(str(p.pid) for p in procs), flush=True)
    time.sleep(600)
"""


def test_a_killed_bench_leaves_no_engine_process(tmp_path):
    """Issue 34 item 10: a bench OOM-killed (here SIGKILLed) took none of its engine processes with it; they kept
    gigabytes each for minutes. The benches start them through ``common.child``: they die with the bench."""
    import signal

    from pdpush.launch import pid_alive
    from tests.helpers import until

    script = tmp_path / "bench.py"
    script.write_text(_KILLED_BENCH)
    bench = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    pids: list[int] = []
    try:
        pids = [int(p) for p in bench.stdout.readline().split()]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        bench.kill()
        bench.wait(10)
        until(lambda: not any(pid_alive(p) for p in pids), 10, "the killed bench's engine processes to exit")
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)


def test_the_box_ceiling_is_the_two_copies_on_the_cores_or_the_one_sender_s_puts():
    """``latency.box_ceiling``: the most layers/s with no pdpush code, which the capacity rows set the target
    against. Both copies share the cores; the puts are one process's."""
    from pdpush_tools.bench.latency import box_ceiling

    # 1 MiB at 8 GB/s (131 us) + 151 us a put: the cores would allow 2 / 282 us = 7,090; one process puts 6,600
    b = box_ceiling(1 << 20, 8.0, 6600.0, cores=2)
    assert b["ops_per_s"] == 6600.0 and round(b["copy_us"]) == 131 and round(b["put_us"]) == 152
    # 64 KiB: 10 us a copy + 10 us a put on 2 cores is 100,000 layers/s, under the puts' 102,000
    b = box_ceiling(80_000, 8.0, 102_000.0, cores=2)
    assert abs(b["ops_per_s"] - 2 / (10e-6 + 1 / 102_000)) < 1e-6 and b["ops_per_s"] < 102_000
    assert box_ceiling(80_000, 8.0, 102_000.0, cores=64)["ops_per_s"] == 102_000.0


def test_a_stamped_source_makes_the_same_bytes_again_and_passes_for_no_other_request_or_layer():
    """``bench.common.StampedSource``: what the concurrency scenario's engines push and its decode side checks. Made
    again from its seed it is the same; another request's layer, or another layer on the same random base, differs."""
    import numpy as np

    from pdpush.layout import KVLayout
    from pdpush_tools.bench.common import StampedSource

    lay = KVLayout(8, 2, 64, "float16", 16)
    ids = list(range(16))
    a, again, other = StampedSource(lay, ids, 1), StampedSource(lay, ids, 1), StampedSource(lay, ids, 2)
    for layer in range(lay.layers):
        mine = a.layer(layer)
        assert all(np.array_equal(x, y) for x, y in zip(mine, again.layer(layer), strict=True))
        assert not any(np.array_equal(x, y) for x, y in zip(mine, other.layer(layer), strict=True))
        same_base = a.layer((layer + StampedSource.BASES) % lay.layers)
        assert not any(np.array_equal(x, y) for x, y in zip(mine, same_base, strict=True))
        assert not np.array_equal(mine[0], mine[1])
        mine[0][:] = 0  # a copy: the next one is whole again
        assert np.array_equal(a.layer(layer)[1], again.layer(layer)[1]) and a.layer(layer)[0].any()



def test_a_bench_stopped_by_sigterm_stops_its_daemons_and_leaves_no_scratch_directory():
    """``pdpush bench`` told to stop mid-run (SIGTERM: a CI timeout, ``kill``) exits 143 through its ``finally``
    blocks (``launch.exit_on_signals``): its daemons stopped by pid, its scratch directory (their sockets and
    logs, made under TMPDIR) gone. The signal's default action left both behind for PR_SET_PDEATHSIG and /tmp."""
    import shutil
    import signal
    import tempfile
    import time

    from pdpush import launch

    tmp_path = Path(tempfile.mkdtemp(prefix="pdpush-t-"))  # short: its daemons' unix socket paths go under it
    env = {k: v for k, v in os.environ.items() if k != "PDPUSH_KEEP_SCRATCH"}
    env["TMPDIR"] = str(tmp_path)
    p = subprocess.Popen([sys.executable, "-m", "pdpush.cli_entry", "bench", "--scenario", "goodput", "--layers", "2",
                          "--kv-heads", "1", "--head-dim", "16", "--dtype", "float16", "--tokens", "64",
                          "--chunk-tokens", "16", "--requests", "1000000"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2:  # the receiver and the sender, ready
            assert p.poll() is None, p.stderr.read()
            assert time.monotonic() < deadline, list(tmp_path.rglob("*"))
            pids = [json.loads(f.read_text())["pid"] for f in tmp_path.glob("pdpush-bench-*/*.ready.json")]
            time.sleep(0.05)  # polling the ready files the daemons write once; bounded by the deadline
        time.sleep(0.5)  # pushing by now
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 128 + signal.SIGTERM, p.stderr.read()
        assert not [d for d in tmp_path.iterdir() if d.name.startswith("pdpush-")], list(tmp_path.rglob("*"))
        assert not [pid for pid in pids if launch.pid_alive(pid)]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        for pid in pids:
            if launch.pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp_path, ignore_errors=True)
