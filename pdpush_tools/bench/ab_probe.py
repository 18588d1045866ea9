"""ab.py's probe, run as a file with a revision's tree first on the path: one engine's one-chunk requests through
real daemons, ``gap_s`` apart (argv: gap_s, requests). Prints one JSON line: medians of the begin, the finish to
its Done, the decode side's open, begin to Done, and the engine's CPU per request; every request read back and
checked; and the files it imported pdpush and pdpush_native from. Only the API every revision has: keep it so."""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import pdpush_native

import pdpush
import pdpush_tools
from pdpush import launch
from pdpush.client import DecodeClient, PrefillClient
from pdpush.layout import KVLayout
from pdpush_tools.bench.common import OBSERVER, Source, verify

WARM = 5


def main() -> None:
    gap_s, n = float(sys.argv[1]), int(sys.argv[2])
    lay = KVLayout(32, 8, 128, "bfloat16", 16)
    wd = launch.scratch_dir("pdpush-ab-")
    rx = launch.start_receiver(wd, pool_pages=8, **lay.to_dict())
    try:
        tx = launch.start_sender(wd, default_receiver=rx.info["control_endpoint"], staging_bytes=64 << 20)
    except BaseException:
        rx.stop()
        raise
    try:
        pc = PrefillClient(lay, tx.info["ingress_endpoint"].removeprefix("ipc://"), timeout_s=60)
        dc = DecodeClient(rx.info["local_endpoint"].removeprefix("ipc://"), timeout_s=60, wait=OBSERVER)
        rng = np.random.default_rng(1)
        src = Source(lay, rng.integers(0, 1 << 31, size=lay.chunk_tokens).tolist(), rng)
        layers = [src.layer(la) for la in range(lay.layers)]
        times: dict[str, list[float]] = {"begin_ms": [], "finish_ms": [], "open_ms": [], "begin_to_done_ms": []}
        verified, cpu0 = True, 0.0
        for i in range(n + WARM):
            if i == WARM:
                cpu0 = time.process_time()
            t0 = time.perf_counter()
            h = pc.begin(f"ab-{i}", rng.integers(0, 1 << 31, size=lay.chunk_tokens).tolist())
            t1 = time.perf_counter()
            for la in range(lay.layers):
                h.put_layer(la, *layers[la])
            t2 = time.perf_counter()
            h.finish(60)
            t3 = time.perf_counter()
            with dc.open(f"ab-{i}") as req:
                t4 = time.perf_counter()
                req.wait_committed(60)
                if i % 10 == 0:  # every request pushes the same bytes, under its own chunk keys
                    verified = verify(req, src, lay) and verified
                req.release()
            if i >= WARM:
                for k, v in zip(times, (t1 - t0, t3 - t2, t4 - t3, t3 - t0), strict=True):
                    times[k].append(v * 1000)
            time.sleep(gap_s)
        out = {k: statistics.median(v) for k, v in times.items()}
        out["probe_cpu_us_per_request"] = (time.process_time() - cpu0) / n * 1e6
        print(json.dumps({**out, "verified": verified, "pdpush": pdpush.__file__, "pdpush_tools": pdpush_tools.__file__,
                          "pdpush_native": pdpush_native.__file__}))
    finally:
        tx.stop()
        rx.stop()


if __name__ == "__main__":
    main()
