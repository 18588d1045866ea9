"""ab.py's bytes probe (``--probe bytes``), run as a file with a revision's tree first on the path: requests of
32 layers of ``layer_kib`` through real daemons, ``gap_s`` apart (argv: gap_s, requests, layer_kib). Per request,
in turn: end to end (``push_one``: begin, each layer copied into staging and handed over, until the decode side
sees the last; and the same from the begin's answer), and transport only (every layer staged first, then handed
over at once, the same thread spinning on the readiness words until the last lands). Prints one JSON line: their
medians in ms, every request read back and checked, and the files it imported pdpush and pdpush_native from. Only
the API every revision has: keep it so."""

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
from pdpush.client import DecodeClient, PrefillClient, WaitPolicy
from pdpush.layout import KVLayout
from pdpush_tools.bench.common import OBSERVER, Source, push_one, verify

WARM = 3


def transport(pc: PrefillClient, dc: DecodeClient, req_id: str, src: Source, lay: KVLayout) -> tuple[float, bool]:
    """``bench.common.push_handed_over``'s timing, spelt out here: the revisions before it have no such helper."""
    h = pc.begin(req_id, src.token_ids)
    req = dc.open(req_id)
    for la in range(lay.layers):
        h.stage_layer(la, *src.layer(la))
    t0 = time.perf_counter()
    h.layers_ready(list(range(lay.layers)))
    for la in range(lay.layers):
        req.wait_layer(la)
    t1 = time.perf_counter()
    h.finish(60)
    req.wait_committed(60)
    ok = verify(req, src, lay)
    req.release()
    return t1 - t0, ok


def main() -> None:
    gap_s, n, kib = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    chunk = min(256, kib // 4)  # 4 KiB a token (8 heads x 128, bf16, K and V): pages of 1 MiB at most
    lay, tokens = KVLayout(32, 8, 128, "bfloat16", chunk), kib // 4
    chunks = -(-tokens // chunk)
    wd = launch.scratch_dir("pdpush-ab-")
    rx = launch.start_receiver(wd, pool_pages=chunks * 3, **lay.to_dict())
    try:
        tx = launch.start_sender(wd, default_receiver=rx.info["control_endpoint"],
                                 staging_bytes=max(64 << 20, 3 * 32 * chunks * lay.page_bytes))
    except BaseException:
        rx.stop()
        raise
    try:
        rx_sock = rx.info["local_endpoint"].removeprefix("ipc://")
        pc = PrefillClient(lay, tx.info["ingress_endpoint"].removeprefix("ipc://"), timeout_s=60)
        dc = DecodeClient(rx_sock, timeout_s=60, wait=OBSERVER)
        spin = DecodeClient(rx_sock, timeout_s=60, wait=WaitPolicy(spin_s=60.0))
        rng = np.random.default_rng(1)
        times: dict[str, list[float]] = {"e2e_ms": [], "begun_ms": [], "transport_ms": []}
        verified = True
        for i in range(n + WARM):
            r = push_one(pc, dc, f"e-{i}", Source(lay, rng.integers(0, 1 << 31, size=tokens).tolist(), rng), lay)
            t, ok = transport(pc, spin, f"t-{i}", Source(lay, rng.integers(0, 1 << 31, size=tokens).tolist(), rng), lay)
            verified = verified and bool(r["verified"]) and ok
            if i >= WARM:
                for k, v in zip(times, (r["seconds"], r["seconds"] - r["begin_s"], t), strict=True):
                    times[k].append(v * 1000)
            time.sleep(gap_s)
        out = {k: statistics.median(v) for k, v in times.items()}
        print(json.dumps({**out, "verified": verified, "pdpush": pdpush.__file__, "pdpush_tools": pdpush_tools.__file__,
                          "pdpush_native": pdpush_native.__file__}))
    finally:
        tx.stop()
        rx.stop()


if __name__ == "__main__":
    main()
