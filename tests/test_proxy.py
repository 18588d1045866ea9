"""pdpush proxy: request rewriting and error paths over real HTTP on loopback.

The happy path between real vLLM servers is tests/test_vllm.py::test_proxy_between_openai_servers.
Here the upstreams are small stdlib HTTP servers so that failures can be provoked on purpose.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdpush.proxy import ProxyConfig, decode_body, make_server, prefill_body


def test_prefill_leg_asks_for_one_token_and_the_push():
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 50, "stream": True, "stream_options": {"x": 1}, "n": 3,
            "max_completion_tokens": 50}
    p = prefill_body(body, "tcp://10.0.0.2:5710")
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["stream"] is False and p["n"] == 1
    assert "stream_options" not in p
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "pdpush_receiver": "tcp://10.0.0.2:5710"}
    assert body["max_tokens"] == 50  # the client's request is not modified
    d = decode_body(body, {"pdpush_req_id": "x"})
    assert d["kv_transfer_params"] == {"pdpush_req_id": "x"} and d["max_tokens"] == 50 and d["stream"] is True
    assert "kv_transfer_params" not in decode_body({**body, "kv_transfer_params": {"a": 1}}, None)


def test_config_is_checked():
    with pytest.raises(ValueError, match="one --decode-receiver per"):
        ProxyConfig(prefill=["http://a"], decode=["http://b", "http://c"], decode_receivers=["tcp://x:1"])
    with pytest.raises(ValueError, match="at least one"):
        ProxyConfig(prefill=[], decode=["http://b"])


class _Upstream(BaseHTTPRequestHandler):
    """Records requests; answers as set in ``reply`` (status, JSON)."""

    seen: list
    reply: tuple

    def log_message(self, *a) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.path, body))
        status, obj = self.reply
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _serve(srv):
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    return t


@pytest.fixture
def upstreams():
    servers = []
    made = {}
    for name, reply in (("prefill", (200, {"choices": [{"text": "a"}], "kv_transfer_params": {"pdpush_req_id": "r1"}})),
                        ("decode", (200, {"choices": [{"text": "abc"}]}))):
        h = type(name, (_Upstream,), {"seen": [], "reply": reply})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), h)
        _serve(srv)
        servers.append(srv)
        made[name] = (f"http://127.0.0.1:{srv.server_address[1]}", h)
    try:
        yield made
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


@pytest.fixture
def proxy(upstreams):
    cfg = ProxyConfig(prefill=[upstreams["prefill"][0]], decode=[upstreams["decode"][0]],
                      decode_receivers=["tcp://127.0.0.1:5710"], port=0, timeout_s=5, max_body_bytes=4096)
    srv = make_server(cfg)
    _serve(srv)
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", srv
    finally:
        srv.shutdown()
        srv.server_close()


def _post(url, data: bytes, timeout=10):
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def test_two_legs_in_order(proxy, upstreams):
    url, _ = proxy
    with _post(url + "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 7}).encode()) as r:
        assert r.headers["X-Pdpush-KV"] == "pushed"
        assert json.loads(r.read())["choices"][0]["text"] == "abc"
    (path, pre), = upstreams["prefill"][1].seen
    (dpath, dec), = upstreams["decode"][1].seen
    assert path == dpath == "/v1/completions"
    assert pre["max_tokens"] == 1 and pre["kv_transfer_params"]["pdpush_receiver"] == "tcp://127.0.0.1:5710"
    assert dec["max_tokens"] == 7 and dec["kv_transfer_params"] == {"pdpush_req_id": "r1"}


@pytest.mark.parametrize("path,data,status", [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", b"x" * 5000, 413),
    ("/v1/embeddings", b"{}", 404),
])
def test_bad_requests_get_clear_errors_and_the_proxy_keeps_serving(proxy, path, data, status):
    url, _ = proxy
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(url + path, data)
    assert e.value.code == status
    assert "error" in json.loads(e.value.read())
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"


def test_upstream_errors_are_relayed(proxy, upstreams):
    url, _ = proxy
    upstreams["prefill"][1].reply = (400, {"error": {"message": "prompt too long"}})
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(url + "/v1/completions", b'{"prompt": "x"}')
    assert e.value.code == 400 and "prompt too long" in e.value.read().decode()
    assert upstreams["decode"][1].seen == []  # no decode leg after a failed prefill


def test_a_dead_upstream_is_a_502(upstreams):
    import socket

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    srv = make_server(ProxyConfig(prefill=[dead], decode=[upstreams["decode"][0]], port=0, timeout_s=2))
    _serve(srv)
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(f"http://127.0.0.1:{srv.server_address[1]}/v1/completions", b'{"prompt": "x"}')
        assert e.value.code == 502
        assert e.value.headers["X-Pdpush-Upstream"].startswith(dead)
    finally:
        srv.shutdown()
        srv.server_close()


def test_prefill_without_params_falls_back_to_recompute(proxy, upstreams):
    url, _ = proxy
    upstreams["prefill"][1].reply = (200, {"choices": [{"text": "a"}], "kv_transfer_params": None})
    with _post(url + "/v1/completions", b'{"prompt": "x", "max_tokens": 3}') as r:
        assert r.headers["X-Pdpush-KV"] == "recomputed"
    assert "kv_transfer_params" not in upstreams["decode"][1].seen[0][1]
