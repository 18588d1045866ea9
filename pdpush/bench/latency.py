"""``pdpush bench --scenario latency``: the fixed cost of a layer, and the sender's capacity in layers/s.

* ``one_chunk_p50_ms`` / ``p99``: a request of one chunk, every layer already in
  staging (as a GPU's DMA would leave it), from hand-over to every layer visible on
  the decode side; every byte checked there.
* ``layer_overhead_us``: per layer, that time less a raw UCX put+flush of the same
  bytes measured in the same run (``ceiling.measure_put``): the cost pdpush adds.
* ``sender_layer_ops_per_s``: several engine *processes* push many one-chunk
  requests through one sender at once; layers per second the sender completed
  (from its own counters). A sample of each engine's requests is checked byte for
  byte on the decode side.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import numpy as np

from pdpush import launch
from pdpush.bench import ceiling
from pdpush.bench.common import Source, push_one, verify
from pdpush.client import DecodeClient, PrefillClient, status
from pdpush.layout import KVLayout


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _engine(layout: dict, sock: str, tag: str, n: int, seed: int, q) -> None:
    """One engine process: ``n`` one-chunk requests, pushed back to back, several in flight at once."""
    lay = KVLayout(**layout)
    pc = PrefillClient(lay, sock, timeout_s=60)
    rng = np.random.default_rng(seed)
    src = Source(lay, rng.integers(0, 1 << 31, size=lay.chunk_tokens).tolist(), rng)
    in_flight = []
    ids = []
    try:
        for i in range(n):
            rid = f"{tag}-{i}"
            h = pc.begin(rid, [seed * 1_000_000 + i * lay.chunk_tokens + t for t in range(lay.chunk_tokens)])
            for layer in range(lay.layers):
                h.put_layer(layer, src.k[layer], src.v[layer])
            h.finish_nowait()
            in_flight.append(h)
            ids.append(rid)
            if len(in_flight) >= 4:
                in_flight.pop(0).poll_done(60)
        for h in in_flight:
            h.poll_done(60)
        q.put({"ids": ids, "token_ids": src.token_ids, "seed": seed, "error": None})
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the run
        q.put({"error": f"{type(e).__name__}: {e}"})
    finally:
        pc.close()


def run(layout: KVLayout, samples: int = 200, engines: int = 4, per_engine: int = 300) -> dict:
    wd = launch.scratch_dir("pdpush-bench-")
    pool_pages = max(256, engines * per_engine + 64)
    daemons: list[launch.Daemon] = []
    try:
        rx = launch.start_receiver(wd, layers=layout.layers, kv_heads=layout.kv_heads, head_dim=layout.head_dim,
                                   dtype=layout.dtype, chunk_tokens=layout.chunk_tokens, pool_pages=pool_pages,
                                   max_leases_per_sender=4096)
        daemons.append(rx)
        tx = launch.start_sender(wd, default_receiver=rx.info["control_endpoint"], staging_bytes=64 << 20)
        daemons.append(tx)
        rx_sock = rx.info["local_endpoint"].removeprefix("ipc://")
        tx_sock = tx.info["ingress_endpoint"].removeprefix("ipc://")
        pc, dc = PrefillClient(layout, tx_sock, timeout_s=60), DecodeClient(rx_sock, timeout_s=60)
        rng = np.random.default_rng(5)
        one, verified = [], True
        for i in range(samples + 20):  # 20 warm-ups
            src = Source(layout, rng.integers(0, 1 << 31, size=layout.chunk_tokens).tolist(), rng)
            r = push_one(pc, dc, f"lat-{i}", src, layout, prestaged=True)
            verified = verified and bool(r["verified"])
            if i >= 20:
                one.append(r["seconds"])
        # capacity: engine processes at once, the sender's own counters
        before = status(tx_sock)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_engine, args=(layout.to_dict(), tx_sock, f"cap{e}", per_engine, 100 + e, q))
                 for e in range(engines)]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        outs = [q.get(timeout=600) for _ in procs]
        wall = time.perf_counter() - t0
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        after = status(tx_sock)
        errors = [o["error"] for o in outs if o["error"]]
        for o in outs:  # a sample of every engine's requests, byte for byte
            if o["error"]:
                continue
            lay_rng = np.random.default_rng(o["seed"])
            src = Source(layout, lay_rng.integers(0, 1 << 31, size=layout.chunk_tokens).tolist(), lay_rng)
            for rid in o["ids"][:: max(1, len(o["ids"]) // 10)]:
                with dc.open(rid, timeout_s=30) as req:
                    verified = verify(req, src, layout) and verified
        pc.close()
        dc.close()
        put = ceiling.measure_put(layout.page_bytes, layout.layers)
    finally:
        for d in daemons:
            d.stop()
    raw_layer_s = layout.page_bytes / (put["median_gbps"] * 1e9)
    p50 = statistics.median(one)
    layers_done = after["layers_pushed"] - before["layers_pushed"]
    return {"scenario": "latency", "layout": layout.to_dict(), "page_bytes": layout.page_bytes,
            "one_chunk_p50_ms": p50 * 1000, "one_chunk_p99_ms": _pct(one, 0.99) * 1000,
            "one_chunk_target_met": p50 * 1000 <= 1.0 * layout.layers / 32,
            "raw_put_us_per_layer": raw_layer_s * 1e6,
            "layer_overhead_us": (p50 / layout.layers - raw_layer_s) * 1e6,
            "layer_overhead_target_met": (p50 / layout.layers - raw_layer_s) * 1e6 <= 30,
            "sender_layer_ops_per_s": layers_done / wall, "engines": engines, "requests_per_engine": per_engine,
            "sender_ops_target_met": layers_done / wall >= 20_000,
            "errors": errors, "samples": len(one), "verified": verified and not errors}
