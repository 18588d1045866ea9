"""Reference speeds measured in the same run: raw UCX put+flush between two processes, and memcpy.

The passive side is ``pdpush_tools.peer``, a region allocated exactly as the receiver's pool is.
``measure_put`` is the active side and uses the same transport code and pattern as the sender:
one put+flush per layer.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np


def measure_put(layer_bytes: int, layers: int, reps: int = 5) -> dict:
    """Median GB/s of ``layers`` x (put ``layer_bytes`` + flush), between two processes."""
    from pdpush.shm import array_at
    from pdpush.transport.base import PutOp
    from pdpush.transport.ucx import UcxWorker
    from pdpush_tools.peer import put_and_wait

    total = layer_bytes * layers
    env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"}
    proc = subprocess.Popen([sys.executable, "-m", "pdpush_tools.peer", str(total)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env)
    try:
        line = proc.stdout.readline()
        info = json.loads(line)
        w = UcxWorker()
        ep = w.connect("127.0.0.1", info["port"])
        ep.set_rkey(bytes.fromhex(info["rkey"]))
        src, _, _ = w.alloc_shared(total)  # the same memory the sender's staging uses
        array_at(src.address, total)[:] = 1  # fault the pages in, as a real staging area would be
        rates = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            for layer in range(layers):
                off = layer * layer_bytes
                put_and_wait(w, ep, [PutOp(src.address + off, info["address"] + off, layer_bytes)], 30.0)
            rates.append(total / (time.perf_counter() - t) / 1e9)
        ep.close()
        src.close()
        rates = rates[1:]  # first pass touches the remote pages
        return {"median_gbps": statistics.median(rates), "samples_gbps": rates}
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def measure_stage(layout, tokens: int, reps: int = 5) -> dict:
    """Median GB/s of the engine's staging copy (``kvcodec.stage``: token-major ``[tokens, heads, D]``
    components into head-major pages, as ``PrefillClient.put_layer`` does) of ``layout.layers`` layers,
    each from and to its own memory: the same bytes and pattern as ``measure_memcpy``, so the two compare."""
    from pdpush import kvcodec
    from pdpush.layout import StagingShares

    n = layout.num_chunks(tokens)
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, (layout.layers, layout.components, tokens, layout.kv_heads, layout.row_bytes),
                       dtype=np.uint8)
    sh = StagingShares(layout, 1, 1, n)
    dst = np.ones((layout.layers, *sh.share_shape()), dtype=np.uint8)  # written before, as staging is
    segs = kvcodec.segments([(0, 0, n)], tokens, layout.chunk_tokens)
    rates = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        for layer in range(layout.layers):
            kvcodec.stage(dst[layer], tuple(src[layer]), sh, 0, segs)
        rates.append(src.nbytes / (time.perf_counter() - t) / 1e9)
    rates = rates[1:]
    return {"median_gbps": statistics.median(rates), "samples_gbps": rates}


def measure_memcpy(layer_bytes: int, layers: int, reps: int = 5) -> dict:
    a = np.ones(layer_bytes * layers, dtype=np.uint8)
    b = np.empty_like(a)
    rates = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        for layer in range(layers):
            s = slice(layer * layer_bytes, (layer + 1) * layer_bytes)
            np.copyto(b[s], a[s])
        rates.append(a.nbytes / (time.perf_counter() - t) / 1e9)
    rates = rates[1:]
    return {"median_gbps": statistics.median(rates), "samples_gbps": rates}

