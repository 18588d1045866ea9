"""``pdpush bench --scenario decode_wait``: how a decode engine should wait for layers (``WaitPolicy``).

A prefill engine (this process) hands a request's layers over one at a time, ``gap`` apart (its
per-layer compute); a decode engine (another process) waits for each layer with one policy and
notes when it saw it. Both clocks are CLOCK_MONOTONIC on one host, so a layer's wake-up latency is
seen - handed over (its put included). The decode process's CPU time per request is the cost.

Policies, each measured at every gap in the same run:
* ``spin``: re-read the readiness words in a tight loop for the whole wait (where cores are spare,
  the latency floor);
* ``nap``: what a DecodeClient did before this scenario chose: a 2 ms spin, then re-reads every
  100 us until 200 ms, then 1 ms waits on the receiver's socket;
* ``receiver-5ms``: a 200 us spin, then woken by the receiver's ``LayerAvailable`` (a blocking wait on
  its socket), re-reading the words every 5 ms;
* ``spin2ms-receiver``: a 2 ms spin, then woken by the receiver, re-reading the words every 5 ms;
* ``default``: ``client.DEFAULT_WAIT``, what a DecodeClient does now.
Every request's bytes are checked on the decode side.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import numpy as np

from pdpush import launch
from pdpush.client import DEFAULT_WAIT, DecodeClient, PrefillClient, WaitPolicy
from pdpush.layout import KVLayout
from pdpush_tools.bench.common import Source, child, verify

POLICIES = {
    "spin": WaitPolicy(spin_s=3600.0, nap_window_s=3600.0),
    "nap": WaitPolicy(spin_s=0.002, nap_s=0.0001, nap_window_s=0.2, slice_s=0.001),
    "receiver-5ms": WaitPolicy(spin_s=0.0002, nap_window_s=0.0002, slice_s=0.005),
    "spin2ms-receiver": WaitPolicy(spin_s=0.002, nap_window_s=0.002, slice_s=0.005),
    "words-250us": WaitPolicy(spin_s=0.0002, nap_window_s=0.0002, slice_s=0.00025),
    "default": DEFAULT_WAIT,
}


def _decoder(rx_sock: str, layout: dict, policy: str, cmd, res) -> None:
    lay = KVLayout(**layout)
    dc = DecodeClient(rx_sock, timeout_s=30, wait=POLICIES[policy])
    try:
        while True:
            job = cmd.get(timeout=120)
            if job is None:
                return
            req_id, seed = job
            req = dc.open(req_id)
            res.put(("open", None))
            cpu0 = time.process_time()
            seen = []
            for layer in range(lay.layers):
                req.wait_layer(layer)
                seen.append(time.monotonic())
            cpu = time.process_time() - cpu0
            rng = np.random.default_rng(seed)
            src = Source(lay, list(range(seed * 1000, seed * 1000 + lay.chunk_tokens)), rng)
            req.wait_committed()
            ok = verify(req, src, lay)
            req.release()
            res.put(("done", {"seen": seen, "cpu_s": cpu, "verified": ok}))
    finally:
        dc.close()


def run(layout: KVLayout, gaps_ms: tuple[float, ...] = (0.2, 2.0, 20.0), requests: int = 12) -> dict:
    wd = launch.scratch_dir("pdpush-bench-")
    daemons: list[launch.Daemon] = []
    rows = []
    try:
        rx = launch.start_receiver(wd, pool_pages=64, committed_ttl_ms=2000, **layout.to_dict())
        daemons.append(rx)
        tx = launch.start_sender(wd, default_receiver=rx.info["control_endpoint"], staging_bytes=64 << 20)
        daemons.append(tx)
        rx_sock = rx.info["local_endpoint"].removeprefix("ipc://")
        tx_sock = tx.info["ingress_endpoint"].removeprefix("ipc://")
        pc = PrefillClient(layout, tx_sock, timeout_s=30)
        ctx = mp.get_context("spawn")
        n = 0
        try:
            for policy in POLICIES:
                cmd, res = ctx.Queue(), ctx.Queue()
                proc = ctx.Process(target=child, args=(_decoder, rx_sock, layout.to_dict(), policy, cmd, res))
                proc.start()
                try:
                    for gap_ms in gaps_ms:
                        lat, cpu, wall, verified = [], [], [], True
                        for i in range(requests + 2):  # two warm-ups
                            n += 1
                            src = Source(layout, list(range(n * 1000, n * 1000 + layout.chunk_tokens)),
                                         np.random.default_rng(n))
                            h = pc.begin(f"dw-{n}", src.token_ids)
                            cmd.put((f"dw-{n}", n))
                            assert res.get(timeout=60)[0] == "open"
                            handed = []
                            t0 = time.monotonic()
                            for layer in range(layout.layers):
                                h.stage_layer(layer, *src.layer(layer))
                                handed.append(time.monotonic())
                                h.layer_ready(layer)
                                time.sleep(gap_ms / 1000)
                            h.finish()
                            kind, out = res.get(timeout=60)
                            if i < 2:
                                continue
                            lat.extend(s - t for s, t in zip(out["seen"], handed, strict=True))
                            cpu.append(out["cpu_s"])
                            wall.append(out["seen"][-1] - t0)
                            verified = verified and out["verified"]
                        lat.sort()
                        rows.append({"policy": policy, "gap_ms": gap_ms,
                                     "wake_p50_us": statistics.median(lat) * 1e6,
                                     "wake_p99_us": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e6,
                                     "cpu_ms_per_request": statistics.median(cpu) * 1e3,
                                     "cpu_share": statistics.median(c / w for c, w in zip(cpu, wall, strict=True)),
                                     "verified": verified})
                finally:
                    cmd.put(None)
                    proc.join(30)
                    if proc.is_alive():
                        proc.kill()
        finally:
            pc.close()
    finally:
        for d in daemons:
            d.stop()
    return {"scenario": "decode_wait", "layout": layout.to_dict(), "requests": requests, "rows": rows,
            "verified": all(r["verified"] for r in rows)}


def print_table(result: dict) -> None:
    print(f"{'policy':<10} {'gap ms':>7} {'wake p50 us':>12} {'p99 us':>9} {'CPU ms/req':>11} {'CPU share':>10}")
    for r in result["rows"]:
        print(f"{r['policy']:<10} {r['gap_ms']:>7.1f} {r['wake_p50_us']:>12.0f} {r['wake_p99_us']:>9.0f} "
              f"{r['cpu_ms_per_request']:>11.2f} {r['cpu_share']:>10.2f}")
    print(f"verified: {result['verified']}")
