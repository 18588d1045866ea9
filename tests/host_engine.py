"""An engine process for the hosts harness (tests/test_two_hosts.py): it runs inside a host, beside its daemon.

    python -m tests.host_engine prefill --sock S --req R --ids 0:48 [--gap-ms 50] [--die-after N] [--hang]
        [--go-file F] [--tp-rank R --tp-size N] [--receiver tcp://host:port]
    python -m tests.host_engine stream --sock S --req R --ids 0:48 --seconds 5 [--receiver tcp://host:port]
    python -m tests.host_engine decode --sock S --req R --ids 0:48 [--expect-failure] [--tp-rank R --tp-size N]

    python -m tests.host_engine serve-prefill --sock S --port P
    python -m tests.host_engine serve-decode --sock S --port P
    python -m tests.host_engine client --url U --prompts 0:48,5000:5016 ...

``serve-*`` are toy OpenAI servers for ``pdpush router``: their prompt is a list of token ids, the prefill
pushes its KV to the receiver and under the push id the router names, and the decode reads every layer of it
and answers whether each byte is what the prompt's KV must be, and from which host. ``client`` posts each
prompt to the router and prints each answer with the router's headers.

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
from pathlib import Path

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
        h = pc.begin(a.req, ids, a.receiver or None, tp_rank=a.tp_rank,  # a TP rank puts its heads of them
                     tp_size=a.tp_size)
        if a.go_file:  # the test does something (holds the link, say) before the layers are handed over
            say(begun=True)
            deadline = time.monotonic() + a.timeout
            while not Path(a.go_file).exists() and time.monotonic() < deadline:
                time.sleep(0.01)
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


def stream(a: argparse.Namespace) -> int:
    """Requests ``<req>-0``, ``<req>-1``... of the same tokens, one after the other, for ``--seconds``: after the
    first, every chunk is held already, so each is the sender's and receiver's round trips alone. Says
    ``streaming`` after the first, then the count and the slowest (a stalled daemon shows there)."""
    from pdpush.client import PrefillClient

    ids = parse_ids(a.ids)
    k, v = token_kv(LAY, ids)
    pc = PrefillClient(LAY, a.sock, timeout_s=a.timeout)
    took: list[float] = []
    try:
        end = None
        while end is None or time.monotonic() < end:
            t0 = time.monotonic()
            h = pc.begin(f"{a.req}-{len(took)}", ids, a.receiver or None)
            for layer in range(LAY.layers):
                h.put_layer(layer, k[layer], v[layer])
            h.finish(timeout_s=a.timeout)
            took.append(time.monotonic() - t0)
            if end is None:
                say(streaming=True)
                end = time.monotonic() + a.seconds
        say(requests=len(took), slowest_s=max(took[1:]), median_s=sorted(took)[len(took) // 2])
        return 0
    except Exception as e:  # noqa: BLE001 - reported to the test
        say(error=type(e).__name__, message=str(e), requests=len(took))
        return 1
    finally:
        pc.close()


def decode(a: argparse.Namespace) -> int:
    from pdpush.client import DecodeClient

    ids = parse_ids(a.ids)
    dc = DecodeClient(a.sock, timeout_s=a.timeout)
    try:
        t0 = time.monotonic()
        with dc.open(a.req, timeout_s=a.timeout, tp_rank=a.tp_rank, tp_size=a.tp_size) as req:
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
        say(k=digest(np.stack(ks)), v=digest(np.stack(vs)), tokens=len(ids), heads=list(req.heads))
        return 0
    except Exception as e:  # noqa: BLE001 - reported to the test
        say(error=type(e).__name__, message=str(e))
        return 1
    finally:
        dc.close()


class _Toy:
    """The toy servers' handler: /health, /v1/models and /v1/completions (the prefill or the decode leg)."""

    def __init__(self, role: str, sock: str) -> None:
        import socket
        import threading

        self.role, self.sock, self.host = role, sock, socket.gethostname()
        self.lock = threading.Lock()  # one leg at a time: a toy, not a scheduler
        self.client = None

    def leg(self, body: dict) -> tuple[int, dict]:
        from pdpush.client import DecodeClient, PrefillClient

        ids = [int(t) for t in body["prompt"]]
        kv = body.get("kv_transfer_params") or {}
        with self.lock:
            if self.role == "prefill":
                self.client = self.client or PrefillClient(LAY, self.sock, timeout_s=30)
                k, v = token_kv(LAY, ids)
                h = self.client.begin(kv["pdpush_push_id"], ids, receiver=kv["pdpush_receiver"])
                for layer in range(LAY.layers):
                    h.put_layer(layer, k[layer], v[layer])
                done = h.finish()
                return 200, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "kv_transfer_params": {
                    "do_remote_prefill": True, "pdpush_req_id": kv["pdpush_push_id"], "pdpush_tokens": len(ids),
                    "pdpush_receiver": kv["pdpush_receiver"]}, "skipped": done.chunks_skipped}
            self.client = self.client or DecodeClient(self.sock, timeout_s=30)
            k, v = token_kv(LAY, ids)
            with self.client.open(kv["pdpush_req_id"]) as req:
                got = [req.kv_bytes(layer, wait=True) for layer in range(LAY.layers)]
            intact = (digest(np.stack([g[0] for g in got])) == digest(k)
                      and digest(np.stack([g[1] for g in got])) == digest(v))
            return 200, {"choices": [{"index": 0, "text": "intact" if intact else "CORRUPT",
                                      "finish_reason": "length"}], "host": self.host}


def serve(a: argparse.Namespace) -> int:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    toy = _Toy(a.role.removeprefix("serve-"), a.sock)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send(200, {"data": [{"id": "m"}]} if self.path == "/v1/models" else {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                self._send(*toy.leg(body))
            except Exception as e:  # noqa: BLE001 - the leg failed: the router sees a 500 and says why
                self._send(500, {"error": {"message": f"{type(e).__name__}: {e}"}})

    srv = ThreadingHTTPServer((a.bind, a.port), Handler)
    say(serving=a.port)
    srv.serve_forever()
    return 0


def client(a: argparse.Namespace) -> int:
    import httpx

    for spec in a.prompts:
        r = httpx.post(a.url + "/v1/completions", json={"model": "m", "prompt": parse_ids(spec), "max_tokens": 4},
                       timeout=60)
        body = r.json()
        say(prompt=spec, status=r.status_code, text=(body.get("choices") or [{}])[0].get("text"),
            host=body.get("host"), prefill=r.headers.get("X-Pdpush-Prefill"), decode=r.headers.get("X-Pdpush-Decode"),
            route=r.headers.get("X-Pdpush-Route"), error=body.get("error"))
    return 0


def metrics(a: argparse.Namespace) -> int:
    """The router's ``/metrics`` at ``--url``, every ``--gap-ms`` for ``--seconds``: one line each, the router's own
    samples as {"name{labels}": value}."""
    import urllib.request

    end = time.monotonic() + a.seconds
    while True:
        with urllib.request.urlopen(a.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        say(t=time.monotonic(), samples={k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines())
                                         if k.startswith("pdpush_router_")})
        if time.monotonic() >= end:
            return 0
        time.sleep(a.gap_ms / 1000)


def publish(a: argparse.Namespace) -> int:
    """vLLM's KV events as its ``ZmqEventPublisher`` frames them (topic, sequence, msgpack batch), on a PUB socket at
    ``--bind``:``--port``: one batch every ``--gap-ms``, each storing a prompt's first block of 16 tokens (hashes
    1, 2, ...; the next prompt each time: a subscriber that joins late follows from there)."""
    import msgpack
    import zmq

    sock = zmq.Context.instance().socket(zmq.PUB)
    sock.bind(f"tcp://{a.bind}:{a.port}")
    say(publishing=a.port)
    seq = 0
    end = time.monotonic() + a.seconds
    while time.monotonic() < end:
        seq += 1
        event = {"type": "BlockStored", "block_hashes": [seq], "parent_block_hash": None,
                 "token_ids": list(range(16 * (seq - 1), 16 * seq)), "block_size": 16, "lora_id": None,
                 "medium": "GPU"}
        sock.send_multipart([b"kv", seq.to_bytes(8, "big", signed=True), msgpack.packb([time.time(), [event], 0])])
        time.sleep(a.gap_ms / 1000)
    sock.close(0)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["prefill", "stream", "decode", "serve-prefill", "serve-decode", "client",
                                    "metrics", "publish"])
    p.add_argument("--receiver", default="", help="the receiver's control endpoint (the sender's default if none)")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--sock", default="")
    p.add_argument("--req", default="")
    p.add_argument("--ids", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--bind", default="0.0.0.0")
    p.add_argument("--url", default="")
    p.add_argument("--prompts", nargs="*", default=[])
    p.add_argument("--gap-ms", type=float, default=0.0)
    p.add_argument("--die-after", type=int, default=0)
    p.add_argument("--hang", action="store_true")
    p.add_argument("--go-file", default="")
    p.add_argument("--expect-failure", action="store_true")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1)
    a = p.parse_args()
    if a.role.startswith("serve-"):
        return serve(a)
    return {"prefill": prefill, "stream": stream, "decode": decode, "client": client, "metrics": metrics,
            "publish": publish}[a.role](a)


if __name__ == "__main__":
    sys.exit(main())
