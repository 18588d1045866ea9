"""An engine process for the hosts harness (tests/test_two_hosts.py): it runs inside a host, beside its daemon.

    python -m tests.host_engine prefill --sock S --req R --ids 0:48 [--gap-ms 50] [--die-after N] [--hang]
    python -m tests.host_engine decode --sock S --req R --ids 0:48 [--expect-failure]

Each token's KV is drawn from a generator seeded by its token id (``token_kv``), so prompts that share a
prefix share its KV, as a real model's do, and a test recomputes any prompt's bytes. Results go to stdout as
one JSON line per event; the last is the outcome.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np

from pdpush.layout import KVLayout

LAY = KVLayout(4, 2, 64, "float16", 16)


def parse_ids(spec: str) -> list[int]:
    """``0:32,1000:1016``: concatenated ranges."""
    out: list[int] = []
    for part in spec.split(","):
        a, b = part.split(":")
        out.extend(range(int(a), int(b)))
    return out


def token_kv(layout: KVLayout, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """[layers, tokens, heads, row bytes] K and V, each token's from its id."""
    row = layout.head_dim * layout.dtype_bytes
    k = np.empty((layout.layers, len(ids), layout.kv_heads, row), np.uint8)
    v = np.empty_like(k)
    for i, t in enumerate(ids):
        rng = np.random.default_rng(t)
        k[:, i] = rng.integers(0, 256, (layout.layers, layout.kv_heads, row), dtype=np.uint8)
        v[:, i] = rng.integers(0, 256, (layout.layers, layout.kv_heads, row), dtype=np.uint8)
    return k, v


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def prefill(a: argparse.Namespace) -> int:
    from pdpush.client import PrefillClient

    ids = parse_ids(a.ids)
    k, v = token_kv(LAY, ids)
    pc = PrefillClient(LAY, a.sock, timeout_s=a.timeout)
    t0 = time.monotonic()
    try:
        h = pc.begin(a.req, ids)
        for layer in range(LAY.layers):
            time.sleep(a.gap_ms / 1000)  # the layer's compute
            h.put_layer(layer, k[layer], v[layer])
            if layer + 1 == a.die_after:
                say(handed=layer + 1)
                if a.hang:  # wait for the rest that never comes: the daemon's death must end the wait
                    t1 = time.monotonic()
                    try:
                        h.finish(timeout_s=a.timeout)
                    except Exception as e:  # noqa: BLE001 - reported to the test
                        say(error=type(e).__name__, message=str(e), waited_s=time.monotonic() - t1)
                        return 1
                time.sleep(600)  # killed here
        done = h.finish(timeout_s=a.timeout)
        say(layers=done.layers, skipped=done.chunks_skipped, bytes=done.bytes_sent, seconds=time.monotonic() - t0)
        return 0
    except Exception as e:  # noqa: BLE001 - reported to the test
        say(error=type(e).__name__, message=str(e), seconds=time.monotonic() - t0)
        return 1
    finally:
        pc.close()


def decode(a: argparse.Namespace) -> int:
    from pdpush.client import DecodeClient

    ids = parse_ids(a.ids)
    dc = DecodeClient(a.sock, timeout_s=a.timeout)
    try:
        t0 = time.monotonic()
        with dc.open(a.req, timeout_s=a.timeout) as req:
            say(opened=True)
            if a.expect_failure:
                try:
                    req.wait_layer(LAY.layers - 1, timeout_s=a.timeout)
                except Exception as e:  # noqa: BLE001 - reported to the test
                    say(error=type(e).__name__, message=str(e), waited_s=time.monotonic() - t0)
                    return 0
                say(error=None)
                return 1
            ks, vs = [], []
            for layer in range(LAY.layers):
                gk, gv = req.kv_bytes(layer, wait=True, timeout_s=a.timeout)
                ks.append(gk)
                vs.append(gv)
        say(k=digest(np.stack(ks)), v=digest(np.stack(vs)), tokens=len(ids))
        return 0
    except Exception as e:  # noqa: BLE001 - reported to the test
        say(error=type(e).__name__, message=str(e))
        return 1
    finally:
        dc.close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--sock", required=True)
    p.add_argument("--req", required=True)
    p.add_argument("--ids", required=True)
    p.add_argument("--gap-ms", type=float, default=0.0)
    p.add_argument("--die-after", type=int, default=0)
    p.add_argument("--hang", action="store_true")
    p.add_argument("--expect-failure", action="store_true")
    p.add_argument("--timeout", type=float, default=30.0)
    a = p.parse_args()
    return prefill(a) if a.role == "prefill" else decode(a)


if __name__ == "__main__":
    sys.exit(main())
