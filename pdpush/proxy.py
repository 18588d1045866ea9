"""``pdpush proxy``: a small disaggregation proxy in front of vLLM prefill and decode instances.

For each OpenAI-style completion request it does what vLLM's own disaggregated examples do:

1. sends the request to a prefill instance with ``max_tokens = 1`` and
   ``kv_transfer_params = {"do_remote_decode": true, "pdpush_receiver": <the decode node's receiver>}``;
   the prefill's ``PdpushConnector`` pushes each layer to that receiver as it is produced;
2. sends the original request to the paired decode instance with the ``kv_transfer_params`` the
   prefill returned; its connector loads the pushed KV instead of recomputing the prompt;
3. relays the decode instance's answer (streamed if the client asked for a stream).

Instances are taken round-robin; decode instance *i* is paired with receiver *i*. Standard
library only (no torch, no vLLM). Binds loopback by default; bodies are capped; every upstream
call has a deadline; upstream errors come back as JSON with the upstream's status (or 502/504).
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("pdpush.proxy")

PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class ProxyConfig:
    prefill: list[str]
    decode: list[str]
    decode_receivers: list[str] = field(default_factory=list)  # receiver control endpoint per decode instance
    host: str = "127.0.0.1"
    port: int = 8100
    timeout_s: float = 300.0
    max_body_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("need at least one --prefill and one --decode URL")
        if self.decode_receivers and len(self.decode_receivers) != len(self.decode):
            raise ValueError("give one --decode-receiver per --decode URL, in the same order (or none)")


class UpstreamError(Exception):
    def __init__(self, status: int, body: bytes, where: str) -> None:
        super().__init__(f"{where}: HTTP {status}")
        self.status, self.body, self.where = status, body, where


def prefill_body(body: dict, receiver: str | None) -> dict:
    """The prefill leg: one token, no stream, and the push asked for."""
    b = copy.deepcopy(body)
    b["max_tokens"] = 1
    if "max_completion_tokens" in b:
        b["max_completion_tokens"] = 1
    b["stream"] = False
    b.pop("stream_options", None)
    b["n"] = 1
    params = {"do_remote_decode": True}
    if receiver:
        params["pdpush_receiver"] = receiver
    b["kv_transfer_params"] = params
    return b


def decode_body(body: dict, kv_transfer_params: dict | None) -> dict:
    """The decode leg: the client's request plus what the prefill returned."""
    b = copy.deepcopy(body)
    if kv_transfer_params:
        b["kv_transfer_params"] = kv_transfer_params
    else:
        b.pop("kv_transfer_params", None)
    return b


class Proxy:
    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self._p = itertools.cycle(range(len(cfg.prefill)))
        self._d = itertools.cycle(range(len(cfg.decode)))
        self._lock = threading.Lock()
        self.counters = {"requests": 0, "pushed": 0, "not_pushed": 0, "errors": 0}

    def pick(self) -> tuple[str, str, str | None]:
        with self._lock:
            p, d = next(self._p), next(self._d)
        rcv = self.cfg.decode_receivers[d] if self.cfg.decode_receivers else None
        return self.cfg.prefill[p].rstrip("/"), self.cfg.decode[d].rstrip("/"), rcv

    def post(self, url: str, body: dict, headers: dict[str, str]):
        req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
        try:
            return urllib.request.urlopen(req, timeout=self.cfg.timeout_s)
        except urllib.error.HTTPError as e:
            raise UpstreamError(e.code, e.read()[:65536], url) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            status = 504 if isinstance(getattr(e, "reason", e), TimeoutError) else 502
            raise UpstreamError(status, json.dumps({"error": {"message": f"{url}: {e}"}}).encode(), url) from None


class _Handler(BaseHTTPRequestHandler):
    proxy: Proxy
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args) -> None:
        log.info("%s " + fmt, self.address_string(), *args)

    def _json(self, status: int, obj: dict | bytes, extra: dict[str, str] | None = None) -> None:
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok", **self.proxy.counters})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        px = self.proxy
        if self.path not in PATHS:
            self._json(404, {"error": {"message": f"no route {self.path}; proxied: {list(PATHS)}"}})
            return
        try:
            n = int(self.headers.get("Content-Length", "-1"))
        except ValueError:
            n = -1
        if n < 0:
            self._json(411, {"error": {"message": "Content-Length required"}})
            return
        if n > px.cfg.max_body_bytes:
            self._json(413, {"error": {"message": f"body over {px.cfg.max_body_bytes} bytes"}})
            self.close_connection = True
            return
        try:
            body = json.loads(self.rfile.read(n))
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            self._json(400, {"error": {"message": f"bad JSON body: {e}"}})
            return
        with px._lock:
            px.counters["requests"] += 1
        auth = {k: v for k, v in (("Authorization", self.headers.get("Authorization")),) if v}
        prefill, decode, receiver = px.pick()
        try:
            with px.post(prefill + self.path, prefill_body(body, receiver), auth) as r:
                pre = json.loads(r.read())
            params = pre.get("kv_transfer_params")
            with px._lock:
                px.counters["pushed" if params else "not_pushed"] += 1
            if not params:
                log.warning("prefill %s returned no kv_transfer_params; the decode instance will recompute", prefill)
            resp = px.post(decode + self.path, decode_body(body, params), auth)
        except UpstreamError as e:
            with px._lock:
                px.counters["errors"] += 1
            log.error("upstream failed: %s", e)
            self._json(e.status, e.body, {"X-Pdpush-Upstream": e.where})
            return
        with resp:
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.headers.get("Content-Type", "application/json"))
            self.send_header("X-Pdpush-KV", "pushed" if params else "recomputed")
            length = resp.headers.get("Content-Length")
            if length is not None:
                self.send_header("Content-Length", length)
            else:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            while True:  # streams (SSE) pass through as they come
                chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
                if not chunk:
                    break
                self.wfile.write(chunk)
                self.wfile.flush()


def make_server(cfg: ProxyConfig) -> ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"proxy": Proxy(cfg)})
    srv = ThreadingHTTPServer((cfg.host, cfg.port), handler)
    srv.daemon_threads = True
    return srv
