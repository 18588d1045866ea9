"""pdpush router: placement (pure logic), then the real router process over HTTP on loopback.

The upstreams here are small stdlib HTTP servers standing in for vLLM instances, so that failures
can be provoked on purpose; the receivers are real daemons (their chunk-index feeds). The router
with real vLLM engines is tests/test_fleet.py.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from pdpush import launch
from pdpush.client import PrefillClient
from pdpush.extra_keys import extras
from pdpush.layout import KVLayout
from pdpush.router.placement import Candidate, Weights, choose_decode, choose_prefill, local_prefill, plan_legs
from tests.helpers import low_nofile_prefix, nofile_limits, until

W = Weights(load=1.0, pool=0.5, max_inflight=8, max_imbalance=2)


# ---- placement -------------------------------------------------------------------------------

def test_the_longest_held_prefix_wins_when_load_is_even():
    c = [Candidate(True, 1, 0), Candidate(True, 1, 3), Candidate(True, 1, 1)]
    d = choose_decode(c, 4, W)
    assert d.index == 1 and d.reason == "prefix_hit" and d.hit_chunks == 3


def test_affinity_is_capped_by_the_imbalance_rule_and_saturation():
    c = [Candidate(True, 0, 0), Candidate(True, 3, 4)]  # holds it all, but 3 more in flight than the idle one
    d = choose_decode(c, 4, W)
    assert d.index == 0 and d.reason == "affinity_capped" and d.best_hit_chunks == 4
    c = [Candidate(True, 8, 0), Candidate(True, 8, 4)]
    assert choose_decode(c, 4, W).reason == "saturated" and choose_decode(c, 4, W).index is None
    assert choose_decode([Candidate(False, 0, 4)], 4, W).reason == "no_healthy"
    assert choose_decode([Candidate(False, 0, 4), Candidate(True, 2, 0)], 4, W).index == 1


def test_load_and_pool_pressure_weigh_against_a_short_hit():
    # 1 chunk of 8 held on a node with 2 in flight and a full pool vs an idle, empty one
    c = [Candidate(True, 2, 1, pages_free=0, pages_total=10), Candidate(True, 0, 0, 10, 10)]
    assert choose_decode(c, 8, W).index == 1 and choose_decode(c, 8, W).reason == "affinity_capped"
    assert choose_decode([Candidate(True, 0, 0), Candidate(True, 0, 0)], 0, W, last=0).index == 1  # ties rotate


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=2, max_size=5), st.integers(0, 50))
def test_skewed_traffic_never_overloads_the_holding_node(holds, seed):
    """Every request shares one hot prefix: a node is only chosen while it has at most max_imbalance
    more in flight than the idlest one, whatever it holds (requests finish at random meanwhile)."""
    rnd = np.random.default_rng(seed)
    inflight = [0] * len(holds)
    for _ in range(60):
        c = [Candidate(True, inflight[i], holds[i]) for i in range(len(holds))]
        d = choose_decode(c, 6, W)
        if d.index is None:
            assert all(x >= W.max_inflight for x in inflight)
        else:
            assert inflight[d.index] <= min(inflight) + W.max_imbalance
            inflight[d.index] += 1
        if rnd.random() < 0.4:  # some finish
            j = int(rnd.integers(len(holds)))
            inflight[j] = max(0, inflight[j] - 1)


def test_round_robin_and_least_loaded_prefill():
    c = [Candidate(True, 0, 5), Candidate(True, 0, 0), Candidate(True, 0, 0)]
    seq, last = [], -1
    for _ in range(4):
        d = choose_decode(c, 5, W, last, cache_aware=False)
        seq.append(d.index)
        last = d.index
    assert seq == [0, 1, 2, 0]
    p = choose_prefill([Candidate(True, 3), Candidate(True, 1), Candidate(False, 0)], W)
    assert p.index == 1 and p.reason == "least_loaded"


def test_both_legs_are_planned_in_one_pure_step():
    """The router's score-based placement (app.py only maps it to routes and metrics): the decode first, then no
    prefill leg where nearly all the prompt is held there, else the least-loaded prefill instance."""
    decodes = [Candidate(True, 0, 3), Candidate(True, 0, 0)]
    prefills = [Candidate(True, 2), Candidate(True, 0)]
    legs = plan_legs(decodes, prefills, 4, W, prompt_tokens=100, chunk_tokens=32, local_prefill_max_tokens=8)
    assert legs.decode.index == 0 and legs.local and legs.prefill is None  # 96 of 100 tokens held there
    legs = plan_legs(decodes, prefills, 4, W, prompt_tokens=100, chunk_tokens=32, local_prefill_max_tokens=0)
    assert legs.decode.index == 0 and not legs.local and legs.prefill.index == 1  # the idle prefill instance
    legs = plan_legs(decodes, prefills, 4, W, cache_aware=False, last_decode=0, prompt_tokens=100, chunk_tokens=32,
                     local_prefill_max_tokens=8)
    assert legs.decode.reason == "round_robin" and legs.decode.index == 1 and not legs.local
    down = plan_legs([Candidate(False, 0)], prefills, 4, W)
    assert down.decode.index is None and down.prefill is None


def test_local_prefill_only_for_a_short_uncovered_suffix():
    assert local_prefill(100, 3, 32, 8)  # 96 held, 4 to compute
    assert not local_prefill(100, 2, 32, 8)  # 36 to compute
    assert not local_prefill(100, 3, 32, 0)  # off
    assert not local_prefill(10, 0, 32, 64)  # nothing held: a normal push


# ---- the router process ------------------------------------------------------------------------

class Upstream(BaseHTTPRequestHandler):
    """A stand-in vLLM instance: records bodies, answers per ``mode``."""

    protocol_version = "HTTP/1.1"
    seen: list  # (path, body) of each POST
    heard: list  # (path, its headers, lower-case names) of each POST
    state: dict  # mode: ok | fail500 | gw504 (a gateway's timeout) | slow | dead | drop | cut | ask (state["ask"](body): its
    # text) ; role ; before(body): called first, in any mode

    def log_message(self, *a) -> None:
        pass

    def _send(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _dead(self) -> bool:
        """mode "dead": the connection drops with no answer, as from a killed process."""
        if self.state.get("mode") == "dead":
            self.close_connection = True
            return True
        return False

    def _hung_up_within(self, seconds: float) -> bool:
        """Sleep ``seconds``, or until the client closes its connection, as vLLM's server notices it (and then
        aborts the request): True if it did."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if select.select([self.connection], [], [], left)[0]:
                return self.connection.recv(1, socket.MSG_PEEK) == b""
        return False

    def do_GET(self) -> None:
        if self._dead():
            return
        if self.path == "/health":
            self._send(200 if self.state.get("healthy", True) else 500, {})
        elif self.path == "/v1/models":
            self.heard.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
            self._send(200, {"data": [{"id": "m"}]})
        else:
            self._send(404, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self._dead():
            return
        self.seen.append((self.path, body))
        self.heard.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
        mode = self.state.get("mode", "ok")
        if self.path == "/tokenize":
            if self.state.get("tokenize") == "slow":  # an engine whose /tokenize has stopped answering
                self._hung_up_within(30.0)
                return
            self._send(200, {"tokens": list(range(1, 1 + len(body.get("prompt", "")))), "count": 0})
            return
        if "before" in self.state:
            self.state["before"](body)  # (a prefill engine that hands its push over, then is slow or dies)
        if mode == "slow" and self._hung_up_within(self.state.get("sleep", 1.0)):
            self.state.setdefault("hung_up", []).append(body.get("kv_transfer_params"))
            return
        if mode in ("fail500", "gw504"):
            self._send(int(mode[-3:]), {"error": {"message": "boom"}})
            return
        if mode == "fail500cut":  # an error answer whose body breaks off (its engine died writing it)
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b'{"error": ')
            self.wfile.flush()
            self.close_connection = True
            return
        if mode == "flood" and body.get("stream"):  # parts as fast as they are taken, up to 256 MiB
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            part = b"data: " + b"x" * (64 << 10) + b"\n\n"
            try:
                for _ in range(4096):
                    self.wfile.write(part)
                self.state["flood_ended"] = "whole"
            except OSError:
                self.state["flood_ended"] = "cut"  # the router broke the leg's connection off
            self.close_connection = True
            return
        if mode == "drop":  # it took the request and died before answering (its health checks still pass)
            self.close_connection = True
            return
        if mode == "ask":  # a decode that asks its receiver about the push, as the connector does
            self._send(200, {"choices": [{"text": self.state["ask"](body)}]})
            return
        if mode == "cut" and body.get("stream"):  # a chunked stream broken off by a dying engine: no final chunk
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            part = f"data: {json.dumps({'i': 0})}\n\n".encode()
            self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            self.wfile.flush()
            self.close_connection = True
            return
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(3):
                self.wfile.write(f"data: {json.dumps({'i': i})}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True
            return
        kv = body.get("kv_transfer_params") or {}
        out = {"choices": [{"text": self.state["role"]}], "kv_transfer_params": (
            {"pdpush_req_id": kv.get("pdpush_push_id"), "do_remote_prefill": True} if kv.get("do_remote_decode")
            else None)}
        self._send(200, out)


@pytest.fixture
def upstreams():
    made = []

    def make(role: str, **state):
        h = type(role, (Upstream,), {"seen": [], "heard": [], "state": {"role": role, **state}})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), h)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        made.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}", h, srv

    try:
        yield make
    finally:
        for s in made:
            s.shutdown()
            s.server_close()


@pytest.fixture
def start_router(tmp_path):
    started = []

    def start(prefill, decode, **opts):
        r = launch.start_router(tmp_path, prefill=prefill, decode=decode, **{"health_interval_s": 0.2,
                                                                             "index_silence_s": 2.0, **opts})
        started.append(r)
        return r

    try:
        yield start
    finally:
        for r in started:
            r.stop()


DEAD_RECEIVER = "tcp://127.0.0.1:9"  # nothing listens: the feed stays unsynced


def post(url: str, body, path: str = "/v1/completions", headers: dict | None = None, timeout: float = 30):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=data, headers={"Content-Type": "application/json", **(headers or {})},
                      timeout=timeout)


def test_both_legs_carry_the_routers_push_id_and_the_clients_is_dropped(upstreams, start_router):
    p_url, p, _ = upstreams("prefill")
    d_url, d, _ = upstreams("decode")
    for legs in ("concurrent", "sequential"):
        r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], concurrent_legs=legs == "concurrent",
                         push_id_prefix=f"t-{legs}")
        body = {"model": "m", "prompt": "hello", "max_tokens": 5, "stream": False,
                "kv_transfer_params": {"pdpush_push_id": "evil", "pdpush_req_id": "evil"}}
        res = post(r.info["url"], body)
        assert res.status_code == 200 and res.json()["choices"][0]["text"] == "decode"
        pid = res.headers["x-pdpush-push-id"]
        assert pid.startswith(f"t-{legs}-") and res.headers["x-pdpush-route"] == legs
        # concurrent legs: the answer does not wait for the prefill leg, which may still be on its way
        pre = until(lambda pid=pid: [b for path, b in p.seen if path == "/v1/completions" and
                             b["kv_transfer_params"]["pdpush_push_id"] == pid], 10, "the prefill leg")[-1]
        dec = [b for path, b in d.seen if path == "/v1/completions"][-1]
        assert pre["max_tokens"] == 1 and pre["kv_transfer_params"] == {
            "do_remote_decode": True, "pdpush_receiver": DEAD_RECEIVER, "pdpush_push_id": pid}
        assert dec["max_tokens"] == 5 and dec["kv_transfer_params"]["pdpush_req_id"] == pid
        assert "evil" not in json.dumps(dec) and "evil" not in json.dumps(pre)
        r.stop()
    # streamed answers pass through as server-sent events
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}])
    res = post(r.info["url"], {"prompt": "x", "stream": True})
    events = [ln for ln in res.text.splitlines() if ln.startswith("data: ")]
    assert res.status_code == 200 and events[-1] == "data: [DONE]" and len(events) == 4
    models = httpx.get(r.info["url"] + "/v1/models", timeout=10)
    assert models.json()["data"][0]["id"] == "m"
    metrics = httpx.get(r.info["url"] + "/metrics", timeout=10).text
    assert 'pdpush_router_decisions_total{leg="decode",reason="load"}' in metrics


def test_by_default_the_legs_go_at_once_unless_the_prefill_instance_is_busy(upstreams, start_router):
    """concurrent_legs "auto": at once where the prefill instance has no leg in flight; behind one, the decode leg
    waits for its own prefill's answer (its engine would otherwise wait for a push that has not begun)."""
    slow = 2.5
    p_url, p, _ = upstreams("prefill", mode="slow", sleep=slow)
    d_url, d, _ = upstreams("decode")
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], prefill_leg_linger_s=60)
    url = r.info["url"]
    first = post(url, {"prompt": "a", "max_tokens": 2})  # answered without waiting for its prefill leg
    assert first.status_code == 200 and first.headers["x-pdpush-route"] == "concurrent"
    t = time.monotonic()
    second = post(url, {"prompt": "b", "max_tokens": 2})  # the first's prefill leg is still computing
    assert second.status_code == 200 and second.headers["x-pdpush-route"] == "sequential"
    assert time.monotonic() - t >= slow  # its decode leg went after its own prefill's answer
    until(lambda: httpx.get(url + "/health").json()["instances"][f"prefill:{p_url}"]["inflight"] == 0, 10,
          "the prefill legs done")
    third = post(url, {"prompt": "c", "max_tokens": 2})
    assert third.status_code == 200 and third.headers["x-pdpush-route"] == "concurrent"
    until(lambda: len([b for path, b in p.seen if path == "/v1/completions"]) == 3, 10, "every prefill leg")
    pushed = [b["kv_transfer_params"]["pdpush_push_id"] for path, b in p.seen if path == "/v1/completions"]
    assert [first.headers["x-pdpush-push-id"], second.headers["x-pdpush-push-id"]] == pushed[:2]


def test_a_prefill_leg_left_running_after_its_decodes_answer_is_cancelled(upstreams, start_router):
    """Both legs at once: once the decode's answer has ended, the prefill leg is needed by nobody (the decode loaded
    the push or recomputed). One still unanswered ``prefill_leg_linger_s`` later (here: queued for 8 s) is cancelled:
    the router hangs up, as vLLM's server notices, and its engine drops the request. One that answers in time is
    counted as pushed, not cancelled. The router's legs also go straight to the engines whatever HTTP_PROXY says."""
    p_url, p, _ = upstreams("prefill", mode="slow", sleep=8.0)
    d_url, _, _ = upstreams("decode")
    proxy = {k: "http://127.0.0.1:9" for k in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")}
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], concurrent_legs=True,
                     prefill_leg_linger_s=0.5, env=proxy)
    url = r.info["url"]
    t = time.monotonic()
    res = post(url, {"prompt": "abc", "max_tokens": 2})
    assert res.status_code == 200 and res.headers["x-pdpush-route"] == "concurrent", res.text
    until(lambda: httpx.get(url + "/health").json()["prefill_cancelled"] == 1, 6, "the leg cancelled")
    until(lambda: p.state.get("hung_up"), 5, "the prefill instance seeing the hang-up")
    assert time.monotonic() - t < 8.0  # not waited out
    assert p.state["hung_up"][0]["pdpush_push_id"] == res.headers["x-pdpush-push-id"]
    health = httpx.get(url + "/health").json()
    assert health["instances"][f"prefill:{p_url}"]["inflight"] == 0 and health["pushed"] == 0
    assert "pdpush_router_prefill_legs_cancelled_total 1.0" in httpx.get(url + "/metrics").text
    p.state.update(sleep=0.2)  # answered within the linger: pushed
    res = post(url, {"prompt": "abd", "max_tokens": 2})
    assert res.status_code == 200 and res.headers["x-pdpush-route"] == "concurrent", res.text
    until(lambda: httpx.get(url + "/health").json()["pushed"] == 1, 6, "the second leg's answer")
    assert httpx.get(url + "/health").json()["prefill_cancelled"] == 1 and len(p.state["hung_up"]) == 1


@pytest.mark.parametrize("legs", ["concurrent", "sequential"])
def test_a_client_that_hangs_up_before_its_answer_cancels_its_legs(upstreams, start_router, legs):
    """A client gone before its (unstreamed) answer: the router hangs up on the engines at once, as vLLM's own
    server does with its clients, so that neither computes an answer for nobody (a decode engine that had not
    loaded its push withdraws it: tests/test_fleet.py). Before, the router waited out both legs."""
    p_url, p, _ = upstreams("prefill", mode="slow", sleep=20.0)
    d_url, d, _ = upstreams("decode", mode="slow", sleep=20.0)
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], concurrent_legs=legs == "concurrent",
                     prefill_leg_linger_s=60)
    url = r.info["url"]
    t = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        post(url, {"prompt": "abc", "max_tokens": 2}, timeout=1.0)
    until(lambda: p.state.get("hung_up"), 10, "the prefill leg hung up on")
    if legs == "concurrent":
        until(lambda: d.state.get("hung_up"), 10, "the decode leg hung up on")
    else:
        assert not [b for path, b in d.seen if path == "/v1/completions"]  # never sent
    assert time.monotonic() - t < 15.0
    health = httpx.get(url + "/health").json()
    until(lambda: all(i["inflight"] == 0 for i in httpx.get(url + "/health").json()["instances"].values()), 10,
          "nothing in flight")
    assert health["prefill_cancelled"] == 0 and health["pushed"] == 0
    until(lambda: 'pdpush_router_requests_total{outcome="client_gone",route="/v1/completions"} 1.0' in
          httpx.get(url + "/metrics").text, 10, "the hang-up counted")
    # one after the other, no decode leg went: its receiver is told that nobody will read the push (protocol.Unread,
    # sent once the hang-up is counted); at once, the decode engine's connector withdraws it
    def unreads() -> int:
        h = httpx.get(url + "/health").json()
        return h["unread_sent"] + h["unread_unsent"]

    if legs == "sequential":
        until(lambda: unreads() == 1, 10, "the Unread")
    else:
        time.sleep(0.5)
        assert unreads() == 0
    p.state.update(mode="ok")
    d.state.update(mode="ok")
    assert post(url, {"prompt": "abd", "max_tokens": 2}).status_code == 200  # it goes on


def test_with_the_routers_connections_all_in_use_a_request_is_busy_and_no_engine_is_ejected(upstreams, start_router):
    """Long answers hold every one of the router's upstream connections (max_upstream_connections): the health
    checks, on connections of their own, keep every engine healthy (they waited for the legs' pool, timed out, and
    ejected every engine: every request then 503 no_healthy), and a new request answers 503 busy, with Retry-After,
    nothing counted against an engine."""
    p_url, p, _ = upstreams("prefill")
    d_url, d, _ = upstreams("decode", mode="slow", sleep=20.0)
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], concurrent_legs=False,
                     max_upstream_connections=2, connect_timeout_s=1.0, max_inflight=64)
    url = r.info["url"]
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        held = [ex.submit(post, url, {"prompt": f"p{i}", "max_tokens": 2}, timeout=12.0) for i in range(2)]
        until(lambda: len([b for path, b in d.seen if path == "/v1/completions"]) == 2, 10, "both decode legs")
        time.sleep(2.5)  # health checks every 0.2 s, each over 1.4 s: ejected after two, before
        health = httpx.get(url + "/health", timeout=5).json()
        assert all(i["healthy"] for i in health["instances"].values()), health
        res = post(url, {"prompt": "third", "max_tokens": 2}, timeout=10.0)
        assert res.status_code == 503 and res.json()["error"]["type"] == "busy", res.text
        assert res.headers["retry-after"] == "1"
        for f in held:
            with pytest.raises(httpx.ReadTimeout):
                f.result()
    metrics = httpx.get(url + "/metrics", timeout=5).text
    assert "pdpush_router_upstream_errors_total{" not in metrics, metrics
    assert all(i["healthy"] for i in httpx.get(url + "/health", timeout=5).json()["instances"].values())


def test_a_prefill_leg_beside_a_decode_leg_that_failed_is_cancelled_at_once(upstreams, start_router):
    """Both legs at once; the decode instance answers its leg with an error. Nobody will read the push: the router
    hangs up on the prefill leg at once (vLLM aborts what its client hung up on), not ``prefill_leg_linger_s``
    later, which is for a leg whose decode may still be loading its push."""
    p_url, p, _ = upstreams("prefill", mode="slow", sleep=20.0)
    d_url, _, _ = upstreams("decode", mode="fail500")
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], concurrent_legs=True,
                     prefill_leg_linger_s=60)
    url = r.info["url"]
    t = time.monotonic()
    assert post(url, {"prompt": "abc", "max_tokens": 2}, timeout=20).status_code == 500
    until(lambda: p.state.get("hung_up"), 10, "the prefill leg hung up on")
    assert time.monotonic() - t < 15.0
    health = httpx.get(url + "/health").json()
    assert health["prefill_cancelled"] == 1 and health["pushed"] == 0 and health["recomputed"] == 0, health


def test_a_decode_leg_that_could_not_be_sent_is_retried_on_a_free_decode_whatever_the_prefill_instances(
        upstreams, start_router):
    """The retry recomputes on another decode instance and needs no prefill instance: with the only one at its
    max_inflight (this request's own leg beside it), the healthy free decode instance went untried, the client had
    a 502 and a rejection was counted for a request that was not rejected."""
    p_url, p, _ = upstreams("prefill", mode="slow", sleep=3.0)
    a_url, a, _ = upstreams("decode", mode="drop")  # placed first; its legs die unanswered
    b_url, b, _ = upstreams("decode")
    r = start_router([p_url], [{"url": a_url, "receiver": DEAD_RECEIVER}, {"url": b_url, "receiver": DEAD_RECEIVER}],
                     concurrent_legs=True, max_inflight=1)
    res = post(r.info["url"], {"prompt": "abc", "max_tokens": 2})
    assert res.status_code == 200 and res.headers["x-pdpush-decode"] == b_url, res.text
    health = httpx.get(r.info["url"] + "/health").json()
    assert health["decode_retries"] == 1 and health["rejected_503"] == 0, health


def test_a_prefill_leg_beside_a_decode_leg_retried_elsewhere_is_cancelled_before_that_answer(upstreams,
                                                                                            start_router):
    """Both legs at once; the decode instance placed takes its leg and dies unanswered, and the router retries the
    leg on another decode instance, recomputing. The push named a receiver that nobody will read now: the prefill
    leg is hung up on then, not when the retried answer (a whole stream, say) ends."""
    p_url, p, _ = upstreams("prefill", mode="slow", sleep=20.0)
    b_url, b, _ = upstreams("decode", mode="slow", sleep=5.0, healthy=False)  # answers after 5 s; not placed first
    a_url, a, _ = upstreams("decode", mode="drop")  # its health checks pass; its legs die unanswered
    r = start_router([p_url], [{"url": a_url, "receiver": DEAD_RECEIVER}, {"url": b_url, "receiver": DEAD_RECEIVER}],
                     concurrent_legs=True, prefill_leg_linger_s=60)
    url = r.info["url"]

    def decodes_healthy():
        return [v["healthy"] for k, v in httpx.get(url + "/health").json()["instances"].items()
                if k.startswith("decode")]

    until(lambda: decodes_healthy().count(False) == 1, 10, "the second decode instance out")

    def readmit(body):  # placed on the first decode instance by now: the second may come back for the retry
        b.state["healthy"] = True
        until(lambda: all(decodes_healthy()), 10, "the second decode instance back")

    a.state["before"] = readmit
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        answer = ex.submit(post, url, {"prompt": "abc", "max_tokens": 2}, timeout=30)
        until(lambda: p.state.get("hung_up"), 10, "the prefill leg hung up on")
        assert not answer.done()  # (the retried decode answers 5 s after its leg)
        assert answer.result().status_code == 200
    health = httpx.get(url + "/health").json()
    assert health["decode_retries"] == 1 and health["prefill_cancelled"] == 1, health


@pytest.mark.parametrize("prefill", ["slow", "drop"])
def test_a_client_gone_while_only_its_prefill_leg_ran_has_its_push_dropped(upstreams, start_router, tmp_path,
                                                                             prefill):
    """One leg after the other, the client hangs up after the prefill engine handed its push over (its last step
    ran): before that engine answered (``slow``), so that no decode leg was sent, or after it died unanswered
    (``drop``), so that the decode leg recomputes and names no push. Either way no decode will read or withdraw
    that push. The router tells the receiver (``Unread``), which drops it at once instead of keeping it unread for
    ``committed_ttl_ms`` (10 minutes by default)."""
    rx = launch.start_receiver(tmp_path, pool_pages=32, **LAY)
    tx = launch.start_sender(tmp_path, staging_bytes=8 << 20)
    try:
        pushed = []

        def push_it(body):
            pushed.append(body["kv_transfer_params"]["pdpush_push_id"])
            push(tx, rx, pushed[-1], list(range(40)))

        p_url, p, _ = upstreams("prefill", mode=prefill, sleep=20.0, before=push_it)
        d_url, d, _ = upstreams("decode", **({"mode": "slow", "sleep": 20.0} if prefill == "drop" else {}))
        r = start_router([p_url], [{"url": d_url, "receiver": rx.info["control_endpoint"]}], concurrent_legs=False,
                         prefill_leg_linger_s=60)
        url = r.info["url"]
        with pytest.raises(httpx.ReadTimeout):
            post(url, {"prompt": "abc", "max_tokens": 2}, timeout=4.0)
        until(lambda: (p if prefill == "slow" else d).state.get("hung_up"), 10, "the leg running hung up on")
        assert pushed and rx_status(rx)["requests_committed"] == 1
        until(lambda: rx_status(rx)["requests_given_up"] == 1, 10, "the unread push dropped")
        st = rx_status(rx)
        assert st["requests_inflight"] == 0 and st["pool_pages_free"] + st["chunks_cached"] == 32, st
        sent = [b for path, b in d.seen if path == "/v1/completions"]
        if prefill == "slow":
            assert not sent  # never sent
        else:  # it recomputes: it names no push
            assert len(sent) == 1 and not (sent[0].get("kv_transfer_params") or {}).get("pdpush_req_id"), sent
        health = httpx.get(url + "/health").json()
        assert health["unread_sent"] == 1 and health["withdraw_sent"] == 0
        assert 'pdpush_pushes_withdrawn_total{by="router_live"} 1.0' in httpx.get(
            rx.info["metrics_endpoint"] + "/metrics").text
    finally:
        tx.stop()
        rx.stop()


def test_a_client_gone_while_its_decode_leg_recomputes_elsewhere_has_its_push_dropped(upstreams, start_router,
                                                                                     tmp_path):
    """The decode instance placed takes its leg and dies unanswered: the router retries the leg on another decode
    instance, recomputing (that one does not know the push). The client hangs up during it: no decode will read or
    withdraw the push on the first instance's receiver, so the router tells that receiver (``Unread``)."""
    rx = launch.start_receiver(tmp_path, pool_pages=32, **LAY)
    tx = launch.start_sender(tmp_path, staging_bytes=8 << 20)
    try:
        p_url, p, _ = upstreams("prefill")
        a_url, a, _ = upstreams("decode", mode="drop")  # its health checks pass; its legs die unanswered
        b_url, b, _ = upstreams("decode", mode="slow", sleep=20.0, healthy=False)  # not placed first
        r = start_router([p_url], [{"url": a_url, "receiver": rx.info["control_endpoint"]},
                                   {"url": b_url, "receiver": DEAD_RECEIVER}], concurrent_legs=False,
                         prefill_leg_linger_s=60)
        url = r.info["url"]

        def decodes_healthy():
            return [v["healthy"] for k, v in httpx.get(url + "/health").json()["instances"].items()
                    if k.startswith("decode")]

        until(lambda: decodes_healthy().count(False) == 1, 10, "the second decode instance out")
        pushed = []

        def push_then_readmit(body):  # placed on the first decode instance by now: the second may come back
            pushed.append(body["kv_transfer_params"]["pdpush_push_id"])
            push(tx, rx, pushed[-1], list(range(40)))
            b.state["healthy"] = True
            until(lambda: all(decodes_healthy()), 10, "the second decode instance back")

        p.state["before"] = push_then_readmit
        with pytest.raises(httpx.ReadTimeout):
            post(url, {"prompt": "abc", "max_tokens": 2}, timeout=6.0)
        until(lambda: b.state.get("hung_up"), 10, "the retried decode leg hung up on")
        assert [path for path, _ in a.seen] == ["/v1/completions"]
        sent = [body for path, body in b.seen if path == "/v1/completions"]
        assert len(sent) == 1 and not (sent[0].get("kv_transfer_params") or {}).get("pdpush_req_id"), sent
        until(lambda: rx_status(rx)["requests_given_up"] == 1, 10, "the unread push dropped")
        health = httpx.get(url + "/health").json()
        assert health["decode_retries"] == 1 and health["unread_sent"] == 1, health
    finally:
        tx.stop()
        rx.stop()


@pytest.mark.parametrize("prefill,decode,unread", [("ok", "fail500", True), ("ok", "drop", True), ("ok", "ok", False),
                                                   ("fail500", "ok", False), ("gw504", "ok", True),
                                                   ("ok", "gw504", False)])
def test_a_push_that_no_decode_engine_took_is_dropped(upstreams, start_router, tmp_path, prefill, decode, unread):
    """One leg after the other, the prefill engine pushes; then the decode instance answers the decode leg with an
    error status (``fail500``), or takes it and dies unanswered (``drop``; there is no other decode instance to
    recompute on). The client gets that error, and nobody will read the push or withdraw it: the router tells its
    receiver (``Unread``), which drops it at once instead of keeping it unread for ``committed_ttl_ms``. A decode
    that answered (``ok``) had the push to read; a prefill leg that failed with an engine's error status pushed
    nothing: neither is told. A gateway's 504 in front of a prefill engine that pushed (``gw504``) is not sure:
    its decode recomputes, and the push is told unread. In front of a decode engine, the engine behind it may still
    read the push: not told."""
    rx = launch.start_receiver(tmp_path, pool_pages=32, **LAY)
    tx = launch.start_sender(tmp_path, staging_bytes=8 << 20)
    try:
        def push_it(body):
            push(tx, rx, body["kv_transfer_params"]["pdpush_push_id"], list(range(40)))

        p_url, _, _ = upstreams("prefill", mode=prefill, **({} if prefill == "fail500" else {"before": push_it}))
        d_url, _, _ = upstreams("decode", mode=decode)
        r = start_router([p_url], [{"url": d_url, "receiver": rx.info["control_endpoint"]}], concurrent_legs=False)
        url = r.info["url"]
        until(lambda: httpx.get(url + "/health").json()["instances"][f"decode:{d_url}"]["index_synced"], 10,
              "the receiver's feed")
        res = post(url, {"prompt": "abc", "max_tokens": 2}, timeout=20)
        assert res.status_code == {"fail500": 500, "drop": 502, "gw504": 504, "ok": 200}[decode], res.text
        if unread:
            until(lambda: rx_status(rx)["requests_given_up"] == 1, 10, "the unread push dropped")
            st = rx_status(rx)
            assert st["requests_inflight"] == 0 and st["pool_pages_free"] + st["chunks_cached"] == 32, st
        else:
            time.sleep(0.5)
            assert rx_status(rx)["requests_given_up"] == 0
            assert rx_status(rx)["requests_committed"] == (prefill == "ok")  # (left to its decode: a stand-in here)
        health = httpx.get(url + "/health").json()
        assert health["unread_sent"] == unread and health["unread_unsent"] == 0 and health["withdraw_sent"] == 0
    finally:
        tx.stop()
        rx.stop()


@pytest.mark.parametrize("legs", ["sequential", "concurrent"])
def test_a_client_gone_while_its_decode_leg_waits_for_a_connection_has_its_push_dropped(upstreams, start_router,
                                                                                        tmp_path, legs):
    """The push commits, and the decode leg waits for its connection: the decode engine's accept queue is full (its
    listener's backlog 0, one connection queued), so the router's SYN is dropped, as under overload. The client
    hangs up meanwhile. The leg never reached the engine, so no decode will read or withdraw the push: the router
    tells its receiver (``Unread``), where before it counted the leg as sent. At once, the prefill leg beside it
    (which pushed, then runs on) is hung up on with its client, not counted as a leg cancelled by the router."""
    rx = launch.start_receiver(tmp_path, pool_pages=32, **LAY)
    tx = launch.start_sender(tmp_path, staging_bytes=8 << 20)
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(0)
    lsn.settimeout(0.05)
    serving, conns = threading.Event(), []

    def serve_health():  # each answer closes its connection: the router keeps none to reuse
        while serving.is_set():
            try:
                c, _ = lsn.accept()
            except OSError:
                continue
            with c:
                c.recv(65536)
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")

    serving.set()
    health_thread = threading.Thread(target=serve_health, daemon=True)
    health_thread.start()
    try:
        def push_it(body):
            push(tx, rx, body["kv_transfer_params"]["pdpush_push_id"], list(range(40)))

        p_url, p, _ = upstreams("prefill", before=push_it, **({"mode": "slow", "sleep": 20.0} if legs == "concurrent"
                                                                else {}))
        d_url = f"http://127.0.0.1:{lsn.getsockname()[1]}"
        r = start_router([p_url], [{"url": d_url, "receiver": rx.info["control_endpoint"]}],
                         concurrent_legs=legs == "concurrent", prefill_leg_linger_s=60)
        url = r.info["url"]
        until(lambda: httpx.get(url + "/health").json()["instances"][f"decode:{d_url}"]["index_synced"], 10,
              "the receiver's feed")
        serving.clear()
        health_thread.join(5)
        filler = socket.socket()  # the queue full (with this, or with a health check's connection made just before)
        conns.append(filler)
        filler.setblocking(False)
        filler.connect_ex(lsn.getsockname())
        with pytest.raises(httpx.ReadTimeout):
            post(url, {"prompt": "abc", "max_tokens": 2}, timeout=2.5)
        assert rx_status(rx)["requests_committed"] == 1
        until(lambda: rx_status(rx)["requests_given_up"] == 1, 10, "the unread push dropped")
        if legs == "concurrent":
            until(lambda: p.state.get("hung_up"), 10, "the prefill leg hung up on")
        health = httpx.get(url + "/health").json()
        assert health["unread_sent"] == 1 and health["prefill_cancelled"] == 0, health
        assert 'pdpush_router_requests_total{outcome="client_gone",route="/v1/completions"} 1.0' in httpx.get(
            url + "/metrics").text
    finally:
        serving.clear()
        for c in conns:
            c.close()
        lsn.close()
        tx.stop()
        rx.stop()


def test_the_router_raises_a_low_open_files_limit(start_router):
    """Started with a soft limit of 1,024 open files (a shell's, or containerd 2's default), the router raises its
    own to its hard limit (up to 65,536): its 1,024 connections to the engines alone would reach 1,024, and a
    connection it cannot open takes an engine for unreachable and ejects it."""
    prefix, hard, want = low_nofile_prefix()
    r = start_router(["http://127.0.0.1:9"], [{"url": "http://127.0.0.1:9", "receiver": DEAD_RECEIVER}],
                     prefix=prefix)
    assert nofile_limits(r.pid) == (want, hard) and r.info["open_files_limit"] == want


@pytest.mark.parametrize("flag,env,mode", [("sequential", None, "sequential"), ("concurrent", "false", "concurrent"),
                                           ("auto", "false", "concurrent")])
def test_the_command_line_names_each_legs_setting_and_wins_over_the_environment(upstreams, start_router, flag, env,
                                                                                 mode):
    """``--legs auto|concurrent|sequential`` (an idle prefill instance: "auto" sends both at once); a flag wins over
    PDPUSH_CONCURRENT_LEGS, as every flag over the environment."""
    p_url, _, _ = upstreams("prefill")
    d_url, _, _ = upstreams("decode")
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], flags=["--legs", flag],
                     concurrent_legs=env)
    res = post(r.info["url"], {"prompt": "abc", "max_tokens": 2})
    assert res.status_code == 200 and res.headers["x-pdpush-route"] == mode


def test_a_legs_setting_the_command_line_does_not_know_is_refused():
    from pdpush import cli

    r = CliRunner().invoke(cli.app, ["router", "--legs", "sometimes"])
    assert r.exit_code == 2 and "--legs 'sometimes': give auto, concurrent or sequential" in r.output, r.output


def test_a_local_tokenizer_without_transformers_is_a_config_error_that_says_so(tmp_path):
    """``tokenizer = "<dir>"`` in a router whose Python has no transformers (the ``router`` extra brings none): exit 2
    with a line saying what to install, not a ModuleNotFoundError traceback."""
    shim = tmp_path / "shim" / "transformers"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('No module named transformers (shim)')\n")
    env = {**os.environ, "PYTHONPATH": f"{shim.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "router", "--port", "0", "--prefill",
                        "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9=tcp://127.0.0.1:9", "--tokenizer",
                        str(tmp_path)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "needs transformers" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_failing_prefill_is_retried_once_elsewhere_and_a_dead_decode_is_ejected(upstreams, start_router):
    p1_url, p1, _ = upstreams("prefill1", mode="fail500")
    p2_url, p2, _ = upstreams("prefill2")
    d1_url, d1, _ = upstreams("decode1")
    d2_url, d2, _ = upstreams("decode2")
    r = start_router([p1_url, p2_url], [{"url": d1_url, "receiver": DEAD_RECEIVER},
                                        {"url": d2_url, "receiver": DEAD_RECEIVER}],
                     concurrent_legs=False, push_id_prefix="t")
    url = r.info["url"]
    for _ in range(4):
        assert post(url, {"prompt": "abc", "max_tokens": 2}).status_code == 200
    n1 = len([b for p, b in p1.seen if p == "/v1/completions"])
    n2 = len([b for p, b in p2.seen if p == "/v1/completions"])
    assert n1 >= 1 and n2 == 4  # every request's prefill ended on the healthy one
    assert httpx.get(url + "/health").json()["prefill_retries"] >= 1
    # a decode instance that goes away: ejected, and later requests go to the other one
    d1.state["mode"] = "dead"
    before = len(d2.seen)
    for _ in range(4):
        res = post(url, {"prompt": "abc", "max_tokens": 2})
        assert res.status_code == 200 and res.json()["choices"][0]["text"] == "decode2"
    assert len(d2.seen) - before == 4
    until(lambda: not httpx.get(url + "/health").json()["instances"][f"decode:{d1_url}"]["healthy"], 10,
          "the dead decode instance ejected")
    # every decode instance failing: an error status, never a 200
    d2.state["mode"] = "fail500"
    res = post(url, {"prompt": "abc", "max_tokens": 2})
    assert res.status_code == 500 and res.headers["x-pdpush-upstream"] == d2_url


def test_an_unhealthy_instance_is_ejected_and_readmitted(upstreams, start_router):
    p_url, _, _ = upstreams("prefill")
    d_url, d, _ = upstreams("decode")
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}])
    url = r.info["url"]
    d.state["healthy"] = False
    until(lambda: httpx.get(url + "/health").status_code == 503, 10, "the decode instance ejected")
    res = post(url, {"prompt": "abc"})
    assert res.status_code == 503 and res.headers["retry-after"] == "1"
    d.state["healthy"] = True
    until(lambda: httpx.get(url + "/health").status_code == 200, 10, "the decode instance re-admitted")
    assert post(url, {"prompt": "abc"}).status_code == 200


def test_saturation_answers_503_with_retry_after(upstreams, start_router):
    p_url, _, _ = upstreams("prefill")
    d_url, d, _ = upstreams("decode", mode="slow", sleep=1.5)
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], max_inflight=1, retry_after_s=2)
    url = r.info["url"]
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("first", post(url, {"prompt": "slow"})))
    t.start()
    until(lambda: any(p == "/v1/completions" for p, _ in d.seen), 10, "the slow request upstream")
    busy = post(url, {"prompt": "x"})
    t.join(30)
    assert busy.status_code == 503 and busy.headers["retry-after"] == "2"
    assert out["first"].status_code == 200


def test_both_legs_carry_the_clients_trace_context_and_authorization(upstreams, start_router):
    p_url, p, _ = upstreams("prefill")
    d_url, d, _ = upstreams("decode")
    trace = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "vendor=x1"}
    for legs in ("sequential", "concurrent"):
        r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], concurrent_legs=legs == "concurrent")
        res = post(r.info["url"], {"prompt": "hello", "max_tokens": 3},
                   headers={**trace, "Authorization": "Bearer engine-key", "X-Other": "no"})
        assert res.status_code == 200
        pre = until(lambda: [h for path, h in p.heard if path == "/v1/completions"], 10, "the prefill leg")[-1]
        dec = [h for path, h in d.heard if path == "/v1/completions"][-1]
        for got in (pre, dec):
            assert {k: got.get(k) for k in trace} == trace and got.get("authorization") == "Bearer engine-key"
            assert "x-other" not in got
        r.stop()
        p.heard.clear()
        d.heard.clear()


def test_upstream_headers_pass_the_trace_context_and_never_the_routers_own_key():
    from pdpush.router.legs import upstream_headers

    inc = {"traceparent": "00-a-b-01", "authorization": "Bearer k", "cookie": "c", "tracestate": "x" * 600}
    plain = {"accept-encoding": "identity"}  # answers uncompressed: a stream is relayed byte for byte
    assert upstream_headers(inc, own_key=False) == {"traceparent": "00-a-b-01", "authorization": "Bearer k", **plain}
    assert upstream_headers(inc, own_key=True) == {"traceparent": "00-a-b-01", **plain}
    # what httpx cannot encode (it refused the leg, and the engine was counted failed) is dropped
    odd = {"traceparent": "00-a-b-01", "tracestate": "a=\u00e9", "authorization": "Bearer \u00e9\n"}
    assert upstream_headers(odd, own_key=False) == {"traceparent": "00-a-b-01", **plain}


def test_headers_httpx_cannot_send_are_dropped_and_count_against_no_engine(upstreams, start_router):
    """A client's trace header that is not ASCII (Starlette reads latin-1) made every leg fail to encode, counted
    against the engine: two such requests ejected every prefill instance and the router answered 503."""
    p_url, p, _ = upstreams("prefill")
    d_url, d, _ = upstreams("decode")
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], health_interval_s=30.0)
    url = r.info["url"]
    for i in range(4):
        res = post(url, {"prompt": "a", "max_tokens": 2}, headers={"tracestate": "a=\u00e9".encode("latin-1"),
                                                                   "traceparent": f"00-t{i}-b-01"})
        assert res.status_code == 200, res.text
    health = httpx.get(url + "/health").json()["instances"]
    assert health[f"prefill:{p_url}"]["healthy"] and not health[f"prefill:{p_url}"]["failures"], health
    assert p.heard[-1][1].get("traceparent") == "00-t3-b-01" and "tracestate" not in p.heard[-1][1]
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer engine-key"}).status_code == 200
    assert d.heard[-1] == ("/v1/models", d.heard[-1][1]) and d.heard[-1][1]["authorization"] == "Bearer engine-key"


def test_an_error_answer_broken_off_is_a_502_and_its_push_is_dropped(upstreams, start_router):
    """The decode engine answers 500 and dies writing the body: a 502 naming it (not the router's 500 with a
    traceback), nothing left in flight, and the push its prefill leg made is told unread to its receiver."""
    p_url, _, _ = upstreams("prefill")
    d_url, _, _ = upstreams("decode", mode="fail500cut")
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], concurrent_legs="false")
    url = r.info["url"]
    res = post(url, {"prompt": "a", "max_tokens": 2})
    assert res.status_code == 502 and res.json()["error"]["type"] == "upstream_error", res.text
    assert "broke off its 500 answer" in res.json()["error"]["message"], res.text
    health = httpx.get(url + "/health").json()
    assert health["instances"][f"decode:{d_url}"]["inflight"] == 0, health
    assert health["unread_sent"] + health["unread_unsent"] == 1, health
    assert "Traceback" not in r.log()


def test_a_streaming_client_that_stops_reading_is_cut_off_and_its_leg_with_it(upstreams, start_router):
    """A streaming client that stays connected but takes nothing (suspended, stuck): past client_write_timeout_s its
    connection is broken off, and the decode leg's too (the engine aborts the request); nothing stays in flight.
    Before, the relay waited on the client's window for good, counted in flight."""
    import socket as so

    p_url, _, _ = upstreams("prefill")
    d_url, d, _ = upstreams("decode", mode="flood")
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], client_write_timeout_s=1.0)
    url = r.info["url"]
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "a", "max_tokens": 4, "stream": True}).encode()
    c = so.socket()
    c.setsockopt(so.SOL_SOCKET, so.SO_RCVBUF, 4096)
    try:
        c.connect((host, int(port)))
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert c.recv(4096).startswith(b"HTTP/1.1 200"), "the stream began"
        until(lambda: d.state.get("flood_ended"), 30, "the decode leg ended")  # the client took nothing since
        assert d.state["flood_ended"] == "cut"
        until(lambda: httpx.get(url + "/health").json()["instances"][f"decode:{d_url}"]["inflight"] == 0, 10,
              "the stream's count undone")
        c.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            while c.recv(1 << 20):  # what was buffered, then the end: the router closed the connection
                pass
    finally:
        c.close()
    log = r.log()
    assert "took no part of its stream" in log and "Traceback" not in log, log
    m = httpx.get(url + "/metrics").text
    assert 'outcome="client_stalled",route="/v1/completions"} 1.0' in m and 'outcome="client_gone"' not in m, m


def test_a_streaming_client_that_hangs_up_is_counted(upstreams, start_router):
    """A streamed answer whose client hangs up part way: counted as client_gone (such a stream was counted under no
    outcome at all), and its leg ends with it."""
    p_url, _, _ = upstreams("prefill")
    d_url, d, _ = upstreams("decode", mode="flood")
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}])
    url = r.info["url"]
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "a", "max_tokens": 4, "stream": True},
                      timeout=30) as res:
        assert res.status_code == 200
        next(res.iter_raw())
    until(lambda: d.state.get("flood_ended"), 30, "the decode leg ended")
    until(lambda: 'outcome="client_gone",route="/v1/completions"} 1.0' in httpx.get(url + "/metrics").text, 10,
          "the hang-up counted")
    assert 'outcome="ok"' not in httpx.get(url + "/metrics").text


def test_the_api_key_guards_the_front(upstreams, start_router, tmp_path):
    p_url, _, _ = upstreams("prefill")
    d_url, d, _ = upstreams("decode")
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], api_key_file=str(key))
    url = r.info["url"]
    assert post(url, {"prompt": "a"}).status_code == 401
    assert post(url, {"prompt": "a"}, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(url + "/v1/models").status_code == 401
    ok = post(url, {"prompt": "a"}, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    assert "authorization" not in d.heard[-1][1]  # the router's key is not passed on


def test_bodies_the_legs_cannot_send_get_a_400_and_leave_no_count_behind(upstreams, start_router):
    """Bodies json.loads takes but the legs cannot send on (NaN, 1e400, a lone surrogate, nesting past the cap) or
    prompts the chunk keys cannot hold: a 400 each, and nothing stays counted in flight. Before, each such body
    was a 500 that left its decode instance counted, and max_inflight of them made the router refuse everything."""
    p_url, p, _ = upstreams("prefill")
    d_url, d, _ = upstreams("decode")
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], max_inflight=2)
    url = r.info["url"]
    bad = ['{"prompt": "a", "temperature": NaN}', '{"prompt": "a", "max_tokens": 1e400}',
           '{"prompt": "\\ud800"}', '{"prompt": "a", "x": ' + "[" * 200 + "]" * 200 + "}",
           '{"prompt": [1, 9223372036854775808]}', '{"prompt": [[1, 2], [-1]]}', '{"prompt": "a", "stream": "no"}']
    for body in bad * 2:
        res = post(url, body)
        assert res.status_code == 400 and "error" in res.json(), (body, res.status_code, res.text)
    health = httpx.get(url + "/health").json()["instances"]
    assert all(i["inflight"] == 0 for i in health.values()), health
    ok = post(url, {"prompt": "a", "max_tokens": 2, "min_tokens": 2})
    assert ok.status_code == 200 and ok.headers["x-pdpush-route"] in ("concurrent", "sequential")
    assert post(url, {"prompt": "a", "max_tokens": 2, "stream": None}).status_code == 200  # as vLLM takes it
    until(lambda: sum(path == "/v1/completions" for path, _ in p.seen) == 2, 10, "the prefill legs")
    assert [b.get("min_tokens") for path, b in p.seen if path == "/v1/completions"] == [1, None]  # vLLM takes it


def test_one_leg_after_the_other_the_decode_instance_is_counted_while_the_prefill_leg_runs(upstreams,
                                                                                        start_router):
    """A request waiting for its prefill leg already counts on its decode instance: requests placed meanwhile
    see it there (the load caps and the cost model's decode wait), as they would once its decode leg went."""
    p_url, p, _ = upstreams("prefill", mode="slow", sleep=2.0)
    d_url, d, _ = upstreams("decode")
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], concurrent_legs=False)
    url = r.info["url"]
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(post, url, {"prompt": "a", "max_tokens": 2})
        until(lambda: any(path == "/v1/completions" for path, _ in p.seen), 10, "the prefill leg")
        health = httpx.get(url + "/health").json()["instances"]
        assert health[f"decode:{d_url}"]["inflight"] == 1 and not d.seen, health  # counted, its leg not sent yet
        assert fut.result().status_code == 200
    health = httpx.get(url + "/health").json()["instances"]
    assert health[f"decode:{d_url}"]["inflight"] == 0, health


def test_a_decode_leg_past_its_upstream_timeout_answers_504_and_is_not_run_again(upstreams, start_router):
    """An unstreamed answer comes whole or not at all: past upstream_timeout_s its engine is still generating it.
    The client gets a 504; the leg is not sent to another decode instance (a second generation that would hit
    the same deadline), and the slow instance is not counted failed."""
    p_url, _, _ = upstreams("prefill")
    slow_url, slow, _ = upstreams("decode", mode="slow", sleep=4.0)
    other_url, other, _ = upstreams("decode")
    r = start_router([p_url], [{"url": slow_url, "receiver": DEAD_RECEIVER},
                               {"url": other_url, "receiver": DEAD_RECEIVER}], upstream_timeout_s=1.0,
                     policy="round_robin")
    url = r.info["url"]
    for _ in range(2):  # round robin: one of them goes to the slow instance
        res = post(url, {"prompt": "a", "max_tokens": 2})
        if res.status_code != 200:
            break
    assert res.status_code == 504 and res.headers["x-pdpush-upstream"] == slow_url, (res.status_code, res.text)
    assert [path for path, _ in other.seen].count("/v1/completions") <= 1  # only its own request, if any
    health = httpx.get(url + "/health").json()["instances"]
    assert health[f"decode:{slow_url}"]["healthy"], health


def test_a_stream_its_decode_breaks_off_is_broken_off_for_the_client_too(upstreams, start_router):
    """The decode instance dies mid-stream: the client's stream must end as cut (no final chunk), not as a whole
    answer that happens to be short; the instance is counted failed, and nothing stays in flight."""
    p_url, _, _ = upstreams("prefill")
    d_url, _, _ = upstreams("decode", mode="cut")
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}])
    url = r.info["url"]
    got = b""
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "a", "max_tokens": 4, "stream": True},
                          timeout=30) as res:
            assert res.status_code == 200
            for part in res.iter_raw():
                got += part
    assert got.startswith(b"data: ")  # what came before the cut was relayed
    until(lambda: httpx.get(url + "/health").json()["instances"][f"decode:{d_url}"]["inflight"] == 0, 10,
          "the stream's count undone")
    log = r.log()  # the relay logs the cut once; not as an error in the ASGI application (a traceback)
    assert "broke the stream" in log and "Traceback" not in log, log


@pytest.fixture
def fuzz_router(upstreams, tmp_path):
    p_url, _, _ = upstreams("prefill")
    d_url, _, _ = upstreams("decode")
    r = launch.start_router(tmp_path, prefill=[p_url], decode=[{"url": d_url, "receiver": DEAD_RECEIVER}],
                            max_body_bytes=4096)
    try:
        yield r.info["url"]
    finally:
        r.stop()


JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                       lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
                       max_leaves=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # ~0.27 s each
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/nope", "/health"]),
       body=st.one_of(st.binary(max_size=300), JSONISH.map(lambda x: json.dumps(x).encode()),
                      st.fixed_dictionaries({"prompt": JSONISH, "stream": JSONISH}).map(lambda x: json.dumps(x).encode()),
                      st.fixed_dictionaries({"messages": JSONISH}).map(lambda x: json.dumps(x).encode()),
                      st.just(b"x" * 5000)))
def test_fuzz_bad_input_gets_a_4xx_and_the_router_keeps_serving(fuzz_router, path, body):
    res = httpx.post(fuzz_router + path, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    streamed = res.status_code == 200 and res.headers["content-type"].startswith("text/event-stream")
    # a body that happens to be a valid streamed request ({"prompt": "x", "stream": true}) is served as a stream
    assert res.status_code < 500 and (streamed or res.headers["content-type"].startswith("application/json")), (
        res, res.text)
    if res.status_code >= 400:
        assert "error" in res.json()
    assert httpx.get(fuzz_router + "/health", timeout=10).status_code == 200


# ---- the index feed from real receivers --------------------------------------------------------

LAY = dict(layers=2, kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=16, model_id="router-test")


def push(tx, rx, rid: str, ids: list[int], extra: list[bytes] | None = None) -> list[int]:
    """Push ``ids`` (zeros) as ``rid``, its chunks' extra keys ``extra``; the items the receiver held already."""
    layout = KVLayout(**LAY)
    pc = PrefillClient(layout, tx.info["ingress_endpoint"].removeprefix("ipc://"),
                       receiver=rx.info["control_endpoint"])
    try:
        h = pc.begin(rid, ids, extra=extra or ())
        z = np.zeros((len(ids), layout.kv_heads, layout.head_dim), np.float16)
        for layer in range(layout.layers):
            h.put_layer(layer, z, z)
        h.finish()
        return h.already_sent_indexes
    finally:
        pc.close()


def rx_status(rx) -> dict:
    from pdpush.client import status

    return status(rx.info["local_endpoint"].removeprefix("ipc://"))


def test_the_router_follows_receivers_indexes_and_rebuilds_after_a_restart(upstreams, start_router, tmp_path):
    p_url, _, _ = upstreams("prefill")
    d_url, _, _ = upstreams("decode")
    rx = launch.start_receiver(tmp_path, pool_pages=32, **LAY)
    tx = launch.start_sender(tmp_path, staging_bytes=8 << 20)
    try:
        push(tx, rx, "a", list(range(40)))  # 3 chunks before the router exists
        r = start_router([p_url], [{"url": d_url, "receiver": rx.info["control_endpoint"]}])
        url = r.info["url"]

        def view():
            return httpx.get(url + "/health").json()["instances"][f"decode:{d_url}"]

        until(lambda: view()["index_synced"] and view()["index_chunks"] == 3, 10, "the snapshot")
        # a second router beside it, with no coordination: its own view from its own subscription
        r2 = start_router([p_url], [{"url": d_url, "receiver": rx.info["control_endpoint"]}])
        until(lambda: httpx.get(r2.info["url"] + "/health").json()["instances"][f"decode:{d_url}"]["index_chunks"]
              == 3, 10, "the second router's snapshot")
        push(tx, rx, "b", list(range(100, 140)))
        until(lambda: view()["index_chunks"] == 6, 10, "the stored event")
        until(lambda: httpx.get(r2.info["url"] + "/health").json()["instances"][f"decode:{d_url}"]["index_chunks"]
              == 6, 10, "the stored event at the second router")
        assert rx_status(rx)["index_subscribers"] == 2
        # a prompt (token ids) the receiver holds 2 chunks of: placed for that prefix
        res = post(url, {"prompt": list(range(32)) + [999] * 5, "max_tokens": 1})
        assert res.status_code == 200
        metrics = httpx.get(url + "/metrics").text
        assert 'pdpush_router_decisions_total{leg="decode",reason="prefix_hit"} 1.0' in metrics
        assert "pdpush_router_hit_chunks_total 2.0" in metrics
        # a cache_salt is in the chunk keys (pdpush.extra_keys), the router's as the engines': the same tokens under a
        # salt hit nothing of the plain push, and a salted push is hit only under its salt
        push(tx, rx, "s", list(range(300, 340)), extras(LAY["chunk_tokens"], salt="tenant-a"))
        until(lambda: view()["index_chunks"] == 9, 10, "the salted push's stored event")
        for salt, prompt, hits in (("tenant-a", list(range(32)), 2), ("tenant-b", list(range(300, 332)), 2),
                                   ("tenant-a", list(range(300, 332)), 4)):
            assert post(url, {"prompt": prompt + [999] * 5, "max_tokens": 1, "cache_salt": salt}).status_code == 200
            assert f"pdpush_router_hit_chunks_total {hits}.0" in httpx.get(url + "/metrics").text, (salt, hits)
        # the receiver restarts (its index is empty): the router's view follows
        port = int(rx.info["control_endpoint"].rsplit(":", 1)[1])
        rx.stop()
        until(lambda: view()["index_chunks"] == 0, 10, "cleared")  # sent on its way out
        rx = launch.start_receiver(tmp_path, pool_pages=32, control_port=port, **LAY)
        tx.stop()
        tx = launch.start_sender(tmp_path, staging_bytes=8 << 20)
        push(tx, rx, "c", list(range(200, 220)))
        until(lambda: view()["index_synced"] and view()["index_chunks"] == 2, 15, "the restarted receiver's index")
    finally:
        tx.stop()
        rx.stop()


def test_a_curve_receivers_feed_is_served_only_to_an_allowed_router(upstreams, start_router, tmp_path):
    """The router's key is a reader's (allowed_readers): it gets the chunk-index feed and nothing else; a Hello with
    it is refused (issue 34 item 7: it used to hand the router the pool's rkey and a UCX token, so a compromised
    router could write any request's KV)."""
    import zmq

    from pdpush import auth, control, protocol

    keys = {n: auth.keygen(tmp_path / "keys", n) for n in ("receiver", "router", "sender")}
    keys["stranger"] = auth.keygen(tmp_path / "elsewhere", "stranger")
    p_url, _, _ = upstreams("prefill")
    d_url, _, _ = upstreams("decode")
    # the senders as a directory of keys, which holds the router's too (as `pdpush keygen --dir` fills one): the
    # router's key, named a reader's, is a reader's only (it had a sender's rights)
    rx = launch.start_receiver(tmp_path, pool_pages=32, curve_secret_key_file=str(keys["receiver"][1]),
                               allowed_senders=[str(tmp_path / "keys")], allowed_readers=[str(keys["router"][0])],
                               **LAY)
    tx = launch.start_sender(tmp_path, staging_bytes=8 << 20, curve_secret_key_file=str(keys["sender"][1]),
                             receiver_public_key=str(keys["receiver"][0]))
    try:
        push(tx, rx, "a", list(range(40)))
        decode = [{"url": d_url, "receiver": rx.info["control_endpoint"],
                   "receiver_public_key": str(keys["receiver"][0])}]
        ok = start_router([p_url], decode, curve_secret_key_file=str(keys["router"][1]))
        bad = start_router([p_url], decode, curve_secret_key_file=str(keys["stranger"][1]))

        def view(r):
            return httpx.get(r.info["url"] + "/health").json()["instances"][f"decode:{d_url}"]

        until(lambda: view(ok)["index_synced"] and view(ok)["index_chunks"] == 3, 10, "the allowed router's snapshot")
        time.sleep(1.0)  # the stranger has had as long: it learnt nothing
        assert not view(bad)["index_synced"] and view(bad)["index_chunks"] == 0
        # the router's own key, as a sender would use it: a typed refusal, no HelloAck
        pair = auth.load_keypair(str(keys["router"][1]))
        s = control.dealer(rx.info["control_endpoint"], protocol.DEFAULT_MAX_FRAME,
                           lambda sock: auth.make_client(sock, pair, auth.load_public_keys(str(keys["receiver"][0]))[0]))
        try:
            lay = KVLayout(**LAY)
            s.send(protocol.encode(protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=lay.fingerprint(),
                                                  layout=protocol.LayoutSpec(**lay.to_dict()))))
            assert s.poll(5000, zmq.POLLIN), "no answer to the router key's Hello"
            reply = protocol.decode(s.recv(), protocol.DEFAULT_MAX_FRAME)
            assert isinstance(reply, protocol.Error) and reply.code.value == "forbidden", reply
        finally:
            s.close()
    finally:
        tx.stop()
        rx.stop()


def asks_until_gone(dc, layout: KVLayout, ids: list[int], wait_s: float):
    """A stand-in decode's answer (Upstream mode "ask"): it asks its receiver about the push, as the connector does,
    every 10 ms up to ``wait_s`` (its push_wait_s): "gone" once the receiver says the push ended, else "waited out".
    A prompt other than ``ids`` is answered "other" at once."""
    def ask(body) -> str:
        if body["prompt"] != ids:
            return "other"
        push_id = body["kv_transfer_params"]["pdpush_req_id"]
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if dc.query(ids, layout, req_id=push_id).request_gone:
                return "gone"
            time.sleep(0.01)
        return "waited out"
    return ask


@pytest.mark.parametrize("prefill_mode", ["fail500", "drop"])
def test_a_prefill_leg_that_surely_failed_beside_its_decode_leg_is_withdrawn_and_the_decode_recomputes_at_once(
        upstreams, start_router, tmp_path, prefill_mode):
    """With both legs at once, the decode leg waits for the push: the connector asks its receiver every 10 ms, up to
    its push_wait_s (2 s by default). A prefill leg that failed wherever it was tried used to leave it waiting all
    that time. The router now tells the receiver that the push will not come (``Withdraw``): the decode's next
    question finds it gone, and a push of it that begins later is refused. The stand-in decode asks as the connector
    does, with a wait far longer than the router's answer takes: "gone" can only come from the withdrawal. A prefill
    leg whose engine took the request and never answered ("drop") may still push: it is not withdrawn, and the
    decode waits for it."""
    from pdpush.client import DecodeClient
    from pdpush.errors import ErrorCode, PdpushError

    rx = launch.start_receiver(tmp_path, pool_pages=32, **LAY)
    tx = launch.start_sender(tmp_path, staging_bytes=8 << 20)
    dc = DecodeClient(rx.info["local_endpoint"].removeprefix("ipc://"), timeout_s=10)
    layout, ids = KVLayout(**LAY), list(range(40))
    ask = asks_until_gone(dc, layout, ids, 20 if prefill_mode == "fail500" else 3)

    try:
        p_url, p, _ = upstreams("prefill", mode=prefill_mode)
        d_url, _, _ = upstreams("decode", mode="ask", ask=ask)
        r = start_router([p_url], [{"url": d_url, "receiver": rx.info["control_endpoint"]}], concurrent_legs=True)
        url = r.info["url"]
        until(lambda: httpx.get(url + "/health").json()["instances"][f"decode:{d_url}"]["index_synced"], 10,
              "the receiver's feed")
        res = post(url, {"prompt": ids, "max_tokens": 1}, timeout=60)
        assert res.status_code == 200 and res.headers["x-pdpush-route"] == "concurrent", res.text
        push_id = res.headers["x-pdpush-push-id"]
        assert [b["kv_transfer_params"]["pdpush_push_id"] for path, b in p.seen if path == "/v1/completions"] == \
            [push_id]  # one try: one prefill instance, nowhere else to try
        if prefill_mode == "drop":
            assert res.json()["choices"][0]["text"] == "waited out"
            health = httpx.get(url + "/health").json()
            assert health["withdraw_sent"] == 0 and health["withdrawn"] == 0 and health["recomputed"] == 1
            assert rx_status(rx)["requests_withdrawn"] == 0
            push(tx, rx, push_id, ids)  # the engine pushes after all: the receiver takes it
            assert rx_status(rx)["requests_committed"] == 1
            return
        assert res.json()["choices"][0]["text"] == "gone"
        until(lambda: httpx.get(url + "/health").json()["withdrawn"] == 1, 10, "the receiver's acknowledgement")
        health = httpx.get(url + "/health").json()
        assert health["withdraw_sent"] == 1 and health["withdraw_unsent"] == 0 and health["recomputed"] == 1
        metrics = httpx.get(url + "/metrics").text
        assert 'pdpush_router_withdrawals_total{outcome="sent"} 1.0' in metrics
        assert 'pdpush_router_withdrawals_total{outcome="acknowledged"} 1.0' in metrics
        assert rx_status(rx)["requests_withdrawn"] == 1
        assert 'pdpush_pushes_withdrawn_total{by="router"} 1.0' in httpx.get(rx_status(rx)["metrics_endpoint"]).text
        with pytest.raises(PdpushError) as refused:  # the prefill engine comes back late: its push is refused
            push(tx, rx, push_id, ids)
        assert refused.value.code is ErrorCode.ABORTED and "withdrawn" in str(refused.value)
        assert rx_status(rx)["requests_total"] == 0
        push(tx, rx, "another", ids)  # the receiver goes on
        assert rx_status(rx)["requests_committed"] == 1
    finally:
        dc.close()
        tx.stop()
        rx.stop()


def test_a_failed_leg_sent_at_once_is_not_retried_behind_a_busy_instance_but_withdrawn(upstreams, start_router,
                                                                                         tmp_path):
    """"auto": a prefill leg sent at once that fails is tried again only on an idle instance, as ``at_once`` decides
    for the first try: its decode is waiting already, and behind another leg the push would begin late. Here the
    other instance is busy, so the leg is given up and withdrawn, and the decode recomputes at once."""
    from pdpush.client import DecodeClient

    rx = launch.start_receiver(tmp_path, pool_pages=32, **LAY)
    dc = DecodeClient(rx.info["local_endpoint"].removeprefix("ipc://"), timeout_s=10)
    layout, ids = KVLayout(**LAY), list(range(40))

    ask = asks_until_gone(dc, layout, ids, 20)

    try:
        busy_url, busy, _ = upstreams("busy", mode="slow", sleep=4.0)
        fail_url, fail, _ = upstreams("failing", mode="fail500")
        d_url, _, _ = upstreams("decode", mode="ask", ask=ask)
        r = start_router([busy_url, fail_url], [{"url": d_url, "receiver": rx.info["control_endpoint"]}],
                         policy="round_robin", prefill_leg_linger_s=60)  # the busy leg stays
        url = r.info["url"]
        until(lambda: httpx.get(url + "/health").json()["instances"][f"decode:{d_url}"]["index_synced"], 10,
              "the receiver's feed")
        first = post(url, {"prompt": "a", "max_tokens": 1})  # round robin: its prefill leg on the slow instance
        assert first.status_code == 200 and first.headers["x-pdpush-prefill"] == busy_url
        res = post(url, {"prompt": ids, "max_tokens": 1}, timeout=60)  # then the failing one, idle: at once
        assert res.status_code == 200 and res.headers["x-pdpush-route"] == "concurrent", res.text
        assert res.json()["choices"][0]["text"] == "gone"
        push_id = res.headers["x-pdpush-push-id"]
        assert [b["kv_transfer_params"]["pdpush_push_id"] for path, b in fail.seen if path == "/v1/completions"] \
            == [push_id]
        until(lambda: httpx.get(url + "/health").json()["withdrawn"] == 1, 10, "the receiver's acknowledgement")
        assert push_id not in [b["kv_transfer_params"]["pdpush_push_id"] for path, b in busy.seen
                               if path == "/v1/completions"]  # not tried again behind the busy instance's leg
        assert httpx.get(url + "/health").json()["prefill_retries"] == 0
    finally:
        dc.close()
        rx.stop()


# ---- cost model: both legs, the prefill engines' own caches, SLO admission -------------------------

def test_a_request_predicted_over_the_slo_gets_429_and_no_leg_runs(upstreams, start_router):
    p_url, p, _ = upstreams("prefill")
    d_url, d, _ = upstreams("decode")
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], policy="cost_model", ttft_slo_ms=1000,
                     prefill_tokens_per_s=2.0, retry_after_s=1)
    url = r.info["url"]
    res = post(url, {"prompt": "abcdefgh", "max_tokens": 2})  # 8 tokens at 2 tokens/s: 4 s predicted
    assert res.status_code == 429 and res.json()["error"]["type"] == "overloaded"
    assert "over the SLO of 1000 ms" in res.json()["error"]["message"] and int(res.headers["retry-after"]) >= 3
    assert not [b for path, b in p.seen + d.seen if path.startswith("/v1/")]  # no leg ran (only /tokenize)
    ok = post(url, {"prompt": "a", "max_tokens": 2})  # 0.5 s predicted: served
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "decode"
    h = httpx.get(url + "/health").json()
    assert h["rejected_slo"] == 1
    m = httpx.get(url + "/metrics").text
    assert "pdpush_router_slo_rejections_total 1.0" in m and "pdpush_router_ttft_predicted_seconds_count 1.0" in m
    assert 'pdpush_router_ttft_observed_seconds_count{stream="no"} 1.0' in m


def test_requests_arriving_together_see_each_others_prefill_load_with_both_legs_at_once(upstreams, start_router):
    """Both legs at once: a prefill leg is counted on its instance when it is placed, not when its task first
    runs, so requests placed in the same moment spread over the prefill instances instead of piling up."""
    (p1_url, p1, _), (p2_url, p2, _) = upstreams("prefill1", mode="slow", sleep=1.5), \
        upstreams("prefill2", mode="slow", sleep=1.5)
    d_url, _, _ = upstreams("decode")
    r = start_router([p1_url, p2_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], policy="cost_model",
                     prefill_tokens_per_s=1000.0, concurrent_legs=True, prefill_leg_linger_s=60)
    url = r.info["url"]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        answers = list(ex.map(lambda i: post(url, {"prompt": f"abcdefgh{i}", "max_tokens": 2}), range(4)))
    assert all(a.status_code == 200 for a in answers)
    assert sorted(a.headers["x-pdpush-prefill"] for a in answers) == sorted([p1_url, p2_url] * 2)
    legs = lambda h: [b for path, b in h.seen if path == "/v1/completions"]  # noqa: E731
    until(lambda: len(legs(p1)) + len(legs(p2)) == 4, 10, "the four prefill legs")
    assert len(legs(p1)) == len(legs(p2)) == 2


def test_a_prefill_leg_that_shared_its_instance_teaches_the_cost_model_nothing(upstreams, start_router):
    """A leg's time measures its instance's speed only if no other leg ran there meanwhile: neither one
    ahead of it nor one that started beside it (both would slow it)."""
    p_url, _, _ = upstreams("prefill", mode="slow", sleep=0.5)
    d_url, _, _ = upstreams("decode")
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], policy="cost_model",
                     prefill_tokens_per_s=1000.0, concurrent_legs=False)
    url = r.info["url"]

    def fit():
        return httpx.get(url + "/health", timeout=10).json()["instances"][f"prefill:{p_url}"]["prefill_fit"]

    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        assert all(a.status_code == 200 for a in ex.map(
            lambda i: post(url, {"prompt": f"abcdefgh{i}", "max_tokens": 2}), range(2)))
    assert fit() == {"tokens_per_s": 1000.0, "overhead_ms": 0.0, "legs_measured": 0}
    assert post(url, {"prompt": "abcdefgh", "max_tokens": 2}).status_code == 200  # alone: 8 tokens in 0.5 s
    f = fit()
    assert f["legs_measured"] == 1 and 5.0 < f["tokens_per_s"] < 17.0, f


def test_the_cost_model_sends_the_prefill_leg_where_the_engines_own_cache_holds_the_prompt(
        upstreams, start_router, tmp_path):
    """Two prefill stand-ins, each with vLLM's own KV event publisher: blocks of a prompt stored on the
    second make the router send that prompt's prefill there, whatever the load order says."""
    from pdpush_tools.harness.ports import free_ports
    from tests.test_kv_events import Publisher

    p1_url, p1, _ = upstreams("prefill1")
    p2_url, p2, _ = upstreams("prefill2")
    d_url, _, _ = upstreams("decode")
    a, b, c, e = free_ports(4)
    pubs = [Publisher(f"tcp://*:{a}", f"tcp://*:{b}", 100), Publisher(f"tcp://*:{c}", f"tcp://*:{e}", 100)]
    try:
        events = {p1_url: {"endpoint": f"tcp://127.0.0.1:{a}", "replay_endpoint": f"tcp://127.0.0.1:{b}", "topic": "kv"},
                  p2_url: {"endpoint": f"tcp://127.0.0.1:{c}", "replay_endpoint": f"tcp://127.0.0.1:{e}", "topic": "kv"}}
        r = start_router([p1_url, p2_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], policy="cost_model",
                         kv_events=events, prefill_tokens_per_s=1000.0, concurrent_legs=False)
        url = r.info["url"]
        prompt = "abcdefghijklmnop"  # the stand-ins tokenize it as 1..16: four blocks of 4
        toks = list(range(1, 17))
        # the second engine holds the first 12 tokens; the first holds another prompt's blocks
        pubs[0].send(["stored", [10, 11], None, [9] * 8, 4])
        until(lambda: pubs[1].send(["stored", [21, 22, 23], None, toks[:12], 4]) or
              httpx.get(url + "/health").json()["instances"][f"prefill:{p2_url}"]["cache_view"]["blocks"] == 3, 30,
              "the router following the second engine's events")
        for _ in range(3):
            assert post(url, {"prompt": prompt, "max_tokens": 2}).status_code == 200
        legs = lambda h: [b for path, b in h.seen if path == "/v1/completions"]  # noqa: E731
        assert len(legs(p2)) == 3 and not legs(p1)
        h = httpx.get(url + "/health").json()["instances"]
        assert h[f"prefill:{p1_url}"]["cache_view"]["blocks"] == 2 and h[f"prefill:{p2_url}"]["cache_view"]["exact"]
        m = httpx.get(url + "/metrics").text
        assert 'pdpush_router_decisions_total{leg="prefill",reason="own_cache"} 3.0' in m
        assert f'pdpush_router_prefill_view_blocks{{instance="{p2_url}"}} 3.0' in m
        # the same prompt under a cache_salt: the engine's blocks of it (its events leave salted blocks out) are
        # not its, and no cache view is counted
        res = post(url, {"prompt": prompt, "max_tokens": 2, "cache_salt": "tenant-a"})
        assert res.status_code == 200 and res.headers["X-Pdpush-Prefill-Cached"] == "0", res.headers
        assert post(url, {"prompt": prompt, "max_tokens": 2}).headers["X-Pdpush-Prefill-Cached"] == "12"
        m = httpx.get(url + "/metrics").text
        assert 'pdpush_router_decisions_total{leg="prefill",reason="own_cache"} 4.0' in m
        assert 'pdpush_router_decisions_total{leg="prefill",reason="extra_keys"} 1.0' in m
    finally:
        for pub in pubs:
            pub.stop()


def test_a_body_that_does_not_come_whole_in_time_is_a_408(upstreams, start_router):
    """A client that sends its headers and trickles its body (or stops) holds the connection for
    client_write_timeout_s at most, then has a 408 (it was held for good, and not counted in flight)."""
    p_url, _, _ = upstreams("prefill")
    d_url, d, _ = upstreams("decode")
    r = start_router([p_url], [{"url": d_url, "receiver": DEAD_RECEIVER}], client_write_timeout_s=1.0)
    host, port = r.info["url"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        s.settimeout(10)
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert not [b for path, b in d.seen if path == "/v1/completions"]
    assert post(r.info["url"], {"prompt": "fine", "max_tokens": 2}).status_code == 200


def test_tokenize_goes_to_the_prefill_instances_in_turn_and_to_another_where_one_does_not_answer(upstreams,
                                                                                                  start_router):
    """tokenizer = "engine": the healthy prefill instances are asked in turn, and a second one where the first does
    not answer in time. The first alone was asked: one whose /tokenize had stopped answering cost every request 10 s
    and its cache-aware placement, while the others were never asked."""
    p0_url, p0, _ = upstreams("prefill", tokenize="slow")
    p1_url, p1, _ = upstreams("prefill")
    d_url, _, _ = upstreams("decode")
    r = start_router([p0_url, p1_url], [{"url": d_url, "receiver": DEAD_RECEIVER}])
    for i in range(2):
        assert post(r.info["url"], {"prompt": f"abc{i}", "max_tokens": 2}).status_code == 200
    asked = lambda h: [b for path, b in h.seen if path == "/tokenize"]  # noqa: E731
    assert len(asked(p1)) == 2 and len(asked(p0)) == 1, (asked(p0), asked(p1))


def test_a_feed_whose_receivers_name_stops_resolving_keeps_its_last_address(tmp_path, monkeypatch):
    """A receiver named by a host name, and a DNS server that fails after the first lookup: a feed that must make a
    new socket (silence, a restarted receiver) goes back to the address its name last gave, as the sender does,
    rather than stay unsubscribed until the DNS answers again. The resolver is a stand-in (Python's getaddrinfo,
    which pdpush's lookups use); the receiver and its feed are real."""
    import asyncio
    import socket as so

    from pdpush.index import IndexView
    from pdpush.router.feeds import Feed

    real = so.getaddrinfo
    dns = {"up": True}

    def fake(host, *a, **kw):
        if host == "rx-0.decode":
            if not dns["up"]:
                raise so.gaierror(so.EAI_AGAIN, "Temporary failure in name resolution")
            return [(so.AF_INET, so.SOCK_STREAM, 6, "", ("127.0.0.1", 0))]
        return real(host, *a, **kw)

    monkeypatch.setattr(so, "getaddrinfo", fake)
    rx = launch.start_receiver(tmp_path, pool_pages=32, **LAY)
    port = rx.info["control_endpoint"].rsplit(":", 1)[1]
    view = IndexView()
    feed = Feed(f"tcp://rx-0.decode:{port}", view, silence_s=2.0)
    loop = asyncio.new_event_loop()
    task = loop.create_task(feed.run())

    def spin(pred, timeout_s: float, what: str) -> None:
        end = time.monotonic() + timeout_s
        while not pred():
            assert time.monotonic() < end, f"timed out waiting for {what}"
            loop.run_until_complete(asyncio.sleep(0.05))

    try:
        spin(lambda: view.synced, 10, "the first snapshot")
        dns["up"] = False
        first = feed.sock
        view.lose()
        feed._renew = True  # what silence does: a fresh socket, which looks the name up again
        spin(lambda: feed.sock is not first and view.synced, 15, "a fresh socket at the last address, synced")
        assert feed._name.address == "127.0.0.1"
    finally:
        task.cancel()
        loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        loop.close()
        feed.close()
        rx.stop()
