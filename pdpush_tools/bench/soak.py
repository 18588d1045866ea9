"""Soak: a randomized concurrent workload with random SIGKILLs of senders and receivers.

Several engine threads (one PrefillClient + DecodeClient each) push requests of
1 chunk up to a large fraction of the pool, with shared prefixes, through 3
senders into 2 receivers, while a chaos thread kills and restarts daemons.
Every chunk's bytes are a function of its chunk key, so the decode side checks
every delivered byte by checksum. At the end every receiver's pool must be
whole: free + cached == total, no lease, nothing quarantined.

``python -m pdpush_tools.bench.soak --seconds 600`` (``make soak``).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from pathlib import Path

import numpy as np
import xxhash

from pdpush import launch
from pdpush.client import DecodeClient, PrefillClient, status
from pdpush.errors import PdpushError
from pdpush.layout import KVLayout, chunk_keys
from pdpush_tools.bench.report import save
from pdpush_tools.harness.ports import free_port

LAYOUT = KVLayout(4, 2, 64, "float16", 16)
POOL_PAGES = 96


def chunk_bytes(key: bytes, layer: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V rows of one chunk of one layer: a pure function of the chunk key (like a real model)."""
    row = LAYOUT.kv_heads * LAYOUT.head_dim * LAYOUT.dtype_bytes
    rng = np.random.default_rng(int.from_bytes(xxhash.xxh3_64_digest(key + bytes([layer])), "little"))
    kv = np.frombuffer(rng.bytes(2 * LAYOUT.chunk_tokens * row), dtype=np.uint8).reshape(2, LAYOUT.chunk_tokens, row)
    return kv[0, :rows], kv[1, :rows]


def request_kv(ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    keys = chunk_keys(ids, LAYOUT)
    T = LAYOUT.chunk_tokens
    ks, vs = [], []
    for layer in range(LAYOUT.layers):
        parts = [chunk_bytes(k, layer, min(T, len(ids) - i * T)) for i, k in enumerate(keys)]
        ks.append(np.concatenate([p[0] for p in parts]))
        vs.append(np.concatenate([p[1] for p in parts]))
    return np.stack(ks), np.stack(vs)


class Fleet:
    """2 receivers and 3 senders on fixed ports/sockets, so that a killed one can come back as itself."""

    def __init__(self, workdir: Path, lease_ms: int, quarantine_ms: int) -> None:
        self.workdir = workdir
        self.lock = threading.Lock()
        self.rx_opts = [dict(control_port=free_port(), ucx_port=free_port(), local_socket=str(workdir / f"rx{i}.sock"),
                             layers=LAYOUT.layers, kv_heads=LAYOUT.kv_heads, head_dim=LAYOUT.head_dim,
                             dtype=LAYOUT.dtype, chunk_tokens=LAYOUT.chunk_tokens, pool_pages=POOL_PAGES,
                             lease_ms=lease_ms, quarantine_ms=quarantine_ms, committed_ttl_ms=5000,
                             verify_checksums=True) for i in range(2)]
        self.tx_opts = [dict(ingress_socket=str(workdir / f"tx{i}.sock"), staging_bytes=32 << 20, checksums=True,
                             control_timeout_ms=2000, layer_timeout_ms=3000, alloc_retry_budget_ms=1000,
                             lease_ms=lease_ms, default_receiver=f"tcp://127.0.0.1:{self.rx_opts[0]['control_port']}")
                        for i in range(3)]
        self.last_kill = 0.0
        self.rx = [launch.start_receiver(workdir, **o) for o in self.rx_opts]
        self.tx = [launch.start_sender(workdir, **o) for o in self.tx_opts]

    def receiver_endpoint(self, i: int) -> str:
        return f"tcp://127.0.0.1:{self.rx_opts[i]['control_port']}"

    def kill_and_restart(self, rnd: random.Random) -> str:
        with self.lock:
            self.last_kill = time.monotonic()
            if rnd.random() < 0.5:
                i = rnd.randrange(len(self.rx))
                self.rx[i].kill()
                self.rx[i].stop()
                time.sleep(rnd.uniform(0.1, 1.0))  # the receiver is down for a while
                self.rx[i] = launch.start_receiver(self.workdir, **self.rx_opts[i])
                return f"receiver{i}"
            i = rnd.randrange(len(self.tx))
            self.last_kill = time.monotonic()
            self.tx[i].kill()
            self.tx[i].stop()
            time.sleep(rnd.uniform(0.1, 1.0))
            self.tx[i] = launch.start_sender(self.workdir, **self.tx_opts[i])
            return f"sender{i}"

    def stop(self) -> None:
        for d in self.tx + self.rx:
            d.stop()


def engine(fleet: Fleet, idx: int, stop_at: float, counts: dict, lock: threading.Lock, seed: int) -> None:
    rnd = random.Random(seed)
    pc = PrefillClient(LAYOUT, fleet.tx_opts[idx]["ingress_socket"], timeout_s=8)
    dcs = [DecodeClient(o["local_socket"], timeout_s=8) for o in fleet.rx_opts]
    prefixes = [[rnd.randrange(1 << 30) for _ in range(LAYOUT.chunk_tokens * 20)] for _ in range(3)]
    n = 0
    try:
        while time.monotonic() < stop_at:
            n += 1
            ri = rnd.randrange(2)
            chunks = rnd.choice([1, 2, 3, 5, 8, 13, int(POOL_PAGES * 0.4)])
            tokens = max(1, chunks * LAYOUT.chunk_tokens - rnd.randrange(LAYOUT.chunk_tokens))
            shared = rnd.randrange(0, min(tokens, len(prefixes[0])) + 1) if rnd.random() < 0.6 else 0
            ids = prefixes[rnd.randrange(3)][:shared] + [rnd.randrange(1 << 30) for _ in range(tokens - shared)]
            req_id = f"e{idx}-{n}-{seed}"
            k, v = request_kv(ids)
            ok = False
            req = None
            try:
                h = pc.begin(req_id, ids, receiver=fleet.receiver_endpoint(ri))
                req = dcs[ri].open(req_id, timeout_s=5)
                for layer in range(LAYOUT.layers):
                    h.put_layer(layer, k[layer], v[layer])
                done = h.finish(timeout_s=8)
                req.wait_committed(8)
                good = _verify(req, k, v, len(ids))
                with lock:
                    counts["requests_ok"] += 1
                    counts["bytes"] += done.bytes_sent
                    counts["chunks_skipped"] += done.chunks_skipped
                    if not good:
                        counts["mismatches"] += 1
                ok = True
            except PdpushError as e:
                since_kill = time.monotonic() - fleet.last_kill
                with lock:
                    counts["failures_detected"] += 1
                    if since_kill < 20:
                        counts["detect_s"].append(since_kill)
                    counts["failure_kinds"][type(e).__name__] = counts["failure_kinds"].get(type(e).__name__, 0) + 1
            finally:
                if req is not None:
                    try:
                        req.release()
                    except PdpushError:
                        pass
                with lock:
                    counts["requests"] += 1
                    if not ok:
                        counts["requests_failed"] += 1
    finally:
        pc.close()
        for d in dcs:
            d.close()


def _verify(req, k: np.ndarray, v: np.ndarray, tokens: int) -> bool:
    for layer in range(LAYOUT.layers):
        got_k, got_v = (x.reshape(tokens, -1) for x in req.kv_bytes(layer, wait=True, timeout_s=8))
        if xxhash.xxh3_64_digest(np.ascontiguousarray(got_k)) != xxhash.xxh3_64_digest(np.ascontiguousarray(k[layer])):
            return False
        if xxhash.xxh3_64_digest(np.ascontiguousarray(got_v)) != xxhash.xxh3_64_digest(np.ascontiguousarray(v[layer])):
            return False
    return True


def run(seconds: float, engines: int = 3, kill_every_s: tuple[float, float] = (3.0, 8.0), seed: int = 1) -> dict:
    lease_ms, quarantine_ms = 2500, 500
    workdir = launch.scratch_dir("pdpush-soak-")
    fleet = Fleet(workdir, lease_ms, quarantine_ms)
    counts = {"requests": 0, "requests_ok": 0, "requests_failed": 0, "bytes": 0, "chunks_skipped": 0, "kills": 0,
              "failures_detected": 0, "mismatches": 0, "failure_kinds": {}, "killed": [], "detect_s": []}
    lock = threading.Lock()
    t0 = time.monotonic()
    stop_at = t0 + seconds
    try:
        threads = [threading.Thread(target=engine, args=(fleet, i, stop_at, counts, lock, seed * 100 + i), daemon=True)
                   for i in range(engines)]
        for t in threads:
            t.start()
        rnd = random.Random(seed)
        while time.monotonic() < stop_at - 2:
            time.sleep(rnd.uniform(*kill_every_s))  # chaos cadence
            if time.monotonic() >= stop_at - 2:
                break
            counts["killed"].append(fleet.kill_and_restart(rnd))
            counts["kills"] += 1
        for t in threads:
            t.join(60)
        # let leases expire and quarantine drain, then the pools must be whole
        time.sleep((lease_ms + quarantine_ms) / 1000 + 1.0)
        pools = []
        for o in fleet.rx_opts:
            st = status(o["local_socket"])
            leaked = st["pool_pages_total"] - st["pool_pages_free"] - st["chunks_cached"] - st["pool_pages_quarantined"]
            pools.append({k: st[k] for k in ("pool_pages_total", "pool_pages_free", "chunks_cached",
                                             "pool_pages_quarantined", "leases_active", "requests_inflight")}
                         | {"leaked_pages": leaked})
    finally:
        fleet.stop()
    counts["leaked_pages"] = sum(p["leaked_pages"] + p["pool_pages_quarantined"] + p["leases_active"] for p in pools)
    counts["pools"] = pools
    counts["seconds"] = time.monotonic() - t0
    d = sorted(counts.pop("detect_s"))
    counts["detect_ms"] = ({"median": 1000 * d[len(d) // 2], "max": 1000 * d[-1], "n": len(d)} if d else {})
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    res = run(a.seconds)
    summary = {k: res[k] for k in ("seconds", "requests", "requests_ok", "requests_failed", "bytes", "chunks_skipped",
                                   "kills", "failures_detected", "detect_ms", "mismatches", "leaked_pages",
                                   "failure_kinds")}
    print(json.dumps(summary, indent=2))
    print(json.dumps(res["pools"], indent=2))
    save(a.json, res)
    raise SystemExit(0 if res["mismatches"] == 0 and res["leaked_pages"] == 0 and res["requests_ok"] > 0 else 1)


if __name__ == "__main__":
    with launch.exit_on_signals():  # SIGTERM stops its daemons and removes its scratch directories
        main()
