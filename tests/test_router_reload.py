"""The router's instance lists read again on SIGHUP: the decision (pdpush/router/reload.py, pure), the router applying
it in process (no sockets), then the real router process with a config file, stand-in vLLM instances and SIGHUP."""

from __future__ import annotations

import json
import os
import signal
import threading
import types
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from pdpush import config as cfgmod
from pdpush import launch
from pdpush.config import RouterConfig
from pdpush.errors import ConfigError
from pdpush.router import legs, reload
from pdpush.router.app import Router
from pdpush.router.fleet import Fleet, Instance
from tests.helpers import until
from tests.test_router import DEAD_RECEIVER, LAY, Upstream, post, push, upstreams  # noqa: F401 - a fixture

A, B, C = "http://a:8100", "http://b:8100", "http://c:8100"


def cfg(prefill: list[str], decode: list[tuple[str, str]], **kw) -> RouterConfig:
    return RouterConfig(prefill=prefill, decode=[{"url": u, "receiver": r} for u, r in decode], **kw)


# ---- the decision --------------------------------------------------------------------------------

def test_kept_instances_keep_their_place_new_ones_are_added_and_the_rest_dropped():
    old = cfg([A, B], [("http://d1:8200", "tcp://d1:5710"), ("http://d2:8200", "tcp://d2:5710")])
    new = cfg([B, C], [("http://d2:8200", "tcp://d2:5710"), ("http://d3:8200", "tcp://d3:5710")])
    p = reload.plan(old, new)
    assert not p.refused and p.changed and p.restart_only == ()
    assert p.prefill.source == (1, None) and p.prefill.drop == (0,)
    assert [k.url for k in p.prefill.kept] == [B] and [k.url for k in p.prefill.added] == [C]
    assert [k.url for k in p.prefill.dropped] == [A]
    assert p.decode.source == (1, None) and [k.url for k in p.decode.dropped] == ["http://d1:8200"]
    line = p.summary()
    assert f"prefill: +{C}; -{A}; 1 kept" in line
    assert "+http://d3:8200 (receiver tcp://d3:5710)" in line and "-http://d1:8200 (receiver tcp://d1:5710)" in line


def test_a_changed_receiver_or_events_source_makes_a_new_instance():
    """The views belong to the source: a decode URL with another receiver, or a prefill URL with other KV events, is
    dropped and added again; a trailing slash is the same URL."""
    old = cfg([A], [("http://d1:8200", "tcp://d1:5710")])
    new = cfg([A + "/"], [("http://d1:8200", "tcp://d1-new:5710")],
              kv_events={A + "/": {"endpoint": "tcp://a:5557"}})
    p = reload.plan(old, new)
    assert p.prefill.source == (None,) and p.prefill.added[0].events == ("tcp://a:5557", "", "")
    assert p.decode.source == (None,) and p.decode.dropped[0].receiver == "tcp://d1:5710"
    assert reload.plan(old, cfg([A + "/"], [("http://d1:8200/", "tcp://d1:5710")])).changed is False


def test_other_fields_wait_for_a_restart_and_an_order_change_is_a_change():
    old = cfg([A, B], [("http://d1:8200", "tcp://d1:5710")])
    same = reload.plan(old, cfg([A, B], [("http://d1:8200", "tcp://d1:5710")], policy="round_robin", port=9000))
    assert not same.changed and same.restart_only == ("policy", "port")
    assert same.summary() == ("no change in the instance lists | changed, taking effect at the next start: "
                              "policy, port")
    swapped = reload.plan(old, cfg([B, A], [("http://d1:8200", "tcp://d1:5710")]))
    assert swapped.changed and swapped.prefill.source == (1, 0) and not swapped.prefill.drop


def test_a_config_the_running_router_cannot_take_is_refused_whole():
    old = cfg([A], [("http://d1:8200", "tcp://d1:5710")])
    twice = reload.plan(old, cfg([A, B, B + "/"], [("http://d1:8200", "tcp://d1:5710")]))
    assert twice.refused == f"prefill: {B} is listed twice" and not twice.changed
    assert twice.summary() == f"refused: prefill: {B} is listed twice"
    keyed = RouterConfig(prefill=[A], curve_secret_key_file="/keys/router.key_secret",
                         decode=[{"url": "http://d2:8200", "receiver": "tcp://d2:5710", "receiver_public_key": "k" * 40}])
    p = reload.plan(old, keyed)
    assert "started without a key pair" in p.refused and "curve_secret_key_file" in p.restart_only
    # an old list with a URL twice (start-up accepts it): the first copy is kept, the second dropped
    dup = reload.diff([reload.PrefillKey(A, None)] * 2, [reload.PrefillKey(A, None)])
    assert dup.source == (0,) and dup.drop == (1,)


def test_a_receivers_key_file_rewritten_in_place_is_a_changed_receiver(tmp_path):
    """A receiver's public key given as a file, the file rotated in place (same path, another key): the decode
    instance is dropped and added again, so its feed subscribes with the new key (it compared the path: unchanged,
    and the feed stayed on the old key until a restart)."""
    import zmq.auth

    d = tmp_path / "keys"
    d.mkdir()
    key = lambda: zmq.auth.create_certificates(str(d), "rx")[0]  # noqa: E731 - (rx.key, rx.key_secret) anew
    path = key()
    decode = [{"url": "http://d1:8200", "receiver": "tcp://d1:5710", "receiver_public_key": path}]
    old = RouterConfig(prefill=[A], curve_secret_key_file=str(d / "rx.key_secret"), decode=decode)
    same = RouterConfig(prefill=[A], curve_secret_key_file=str(d / "rx.key_secret"), decode=decode)
    assert not reload.plan(old, same).changed
    assert key() == path  # rewritten in place
    new = RouterConfig(prefill=[A], curve_secret_key_file=str(d / "rx.key_secret"), decode=decode)
    p = reload.plan(old, new)
    assert p.changed and p.decode.drop == (0,) and p.decode.source == (None,) and not p.refused


def test_a_dropped_instance_is_retired_until_its_requests_in_flight_end():
    a, b, d = Instance("prefill", A), Instance("prefill", B), Instance("decode", "http://d1:8200")
    f = Fleet([a], [d])
    a.inflight = 1
    f.replace([b], [d], [a])
    assert f.prefill == [b] and f.retired == [a] and f.reap() == [] and f.retired == [a]
    a.inflight = 0
    assert f.reap() == [a] and f.retired == []
    with pytest.raises(ValueError):
        f.replace([], [d], [])


def test_an_engine_relisted_by_a_reload_counts_the_legs_its_retired_entry_still_runs():
    """A reload that changes only how the router follows a prefill engine (its KV events) retires the old entry and
    lists a new one for the same URL: "auto" must see the legs still running there, not an idle engine."""
    old, d = Instance("prefill", A), Instance("decode", "http://d1:8200")
    f = Fleet([old], [d])
    old.inflight = 2
    new, other = Instance("prefill", A), Instance("prefill", B)
    f.replace([new, other], [d], [old])
    new.inflight = 1
    assert f.inflight_at(new) == 3 and f.inflight_at(other) == 0
    assert not legs.at_once("auto", f.inflight_at(new)) and legs.at_once("auto", f.inflight_at(other))
    old.inflight = 0
    assert f.reap() == [old] and f.inflight_at(new) == 1


def test_the_router_applies_the_plan_keeping_the_instances_state():
    """Router.take without sockets (not started): kept instances are the same objects, with their counts."""
    r = Router(cfg([A, B], [("http://d1:8200", "tcp://d1:5710")]))
    a, b, d1 = r.fleet.prefill[0], r.fleet.prefill[1], r.fleet.decode[0]
    b.ejections, d1.inflight = 3, 2
    p = r.take(cfg([B, C], [("http://d1:8200", "tcp://d1:5710"), ("http://d2:8200", "tcp://d2:5710")]))
    assert p.changed and r.fleet.prefill[0] is b and b.ejections == 3 and r.fleet.prefill[1].url == C
    assert r.fleet.decode[0] is d1 and d1.inflight == 2 and r.fleet.decode[1].receiver == "tcp://d2:5710"
    assert a not in r.fleet.retired  # nothing in flight there: forgotten at once
    assert [u.rstrip("/") for u in r.cfg.prefill] == [B, C] and len(r.cfg.decode) == 2
    assert r.last_reload.startswith("applied: prefill: +http://c:8100; -http://a:8100; 1 kept")
    before = (list(r.fleet.prefill), list(r.fleet.decode))
    refused = r.take(cfg([B], [("http://d1:8200", "tcp://d1:5710")] * 2))
    assert refused.refused and (r.fleet.prefill, r.fleet.decode) == before
    assert r.last_reload.startswith("refused: decode: http://d1:8200 is listed twice")


def test_a_dropped_instance_leaves_no_series_and_no_speed_behind():
    """Once a dropped instance has nothing in flight, /metrics names it no more (counters included: a fleet that
    churns through pod addresses grew a series per address for the router's life) and its learned speed goes."""
    from prometheus_client import generate_latest

    d1, d2 = ("http://d1:8200", "tcp://d1:5710"), ("http://d2:8200", "tcp://d2:5710")
    r = Router(cfg([A, B], [d1, d2]))
    m = r.metrics
    for url in (A, B, d2[0]):
        m.upstream_errors.labels(url).inc()
        m.healthy.labels(url).set(1)
    r.fleet.prefill[0].cache = types.SimpleNamespace(resyncs={"gap": 2}, by_hash={})  # (its KV events' view)
    m.prefill_view_resyncs.labels(A, "gap").set(2)
    m.index_resyncs.labels(d2[1]).inc()
    r.estimates.observe_prefill(A, 1000, 0.0, 1.0)
    r.take(cfg([B], [d1]))
    text = generate_latest(m.registry).decode()
    assert A not in text and d2[0] not in text and d2[1] not in text, text
    assert f'pdpush_router_upstream_errors_total{{instance="{B}"}} 1.0' in text
    assert A not in r.estimates.samples


def test_config_reload_reads_the_file_again_with_the_same_overrides(tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith("PDPUSH_")]:
        monkeypatch.delenv(k)
    f = tmp_path / "router.toml"
    f.write_text(f'prefill = ["{A}"]\nport = 1\n[[decode]]\nurl = "http://d1:8200"\nreceiver = "tcp://d1:5710"\n')
    c = cfgmod.load(RouterConfig, f, port=2)
    f.write_text(f'prefill = ["{B}"]\nport = 3\n[[decode]]\nurl = "http://d1:8200"\nreceiver = "tcp://d1:5710"\n')
    again = cfgmod.reload(c)
    assert again.prefill == [B] and again.port == 2  # the file as it is now; the flag still wins
    f.write_text("prefill = [")
    with pytest.raises(ConfigError, match="invalid RouterConfig"):
        cfgmod.reload(c)
    with pytest.raises(ConfigError, match="no config file"):
        cfgmod.reload(cfg([A], [("http://d1:8200", "tcp://d1:5710")]))


# ---- the router process ----------------------------------------------------------------------------

class Gated(Upstream):
    """A stand-in vLLM instance whose completions wait until ``state["gate"]`` is set (``state["arrived"]`` says one
    is waiting)."""

    def do_POST(self) -> None:
        if self.path.startswith("/v1/"):
            self.state["arrived"].set()
            self.state["gate"].wait(60)
        super().do_POST()


@pytest.fixture
def gated():
    made = []

    def make(role: str):
        gate = threading.Event()
        h = type(role, (Gated,), {"seen": [], "heard": [], "state": {"role": role, "gate": gate,
                                                                     "arrived": threading.Event()}})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), h)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        made.append((srv, gate))
        return f"http://127.0.0.1:{srv.server_address[1]}", h, gate

    try:
        yield make
    finally:
        for srv, gate in made:
            gate.set()
            srv.shutdown()
            srv.server_close()


def write(path: Path, prefill: list[str], decode: list[str], extra: str = "") -> None:
    """A router config file (port 0, quick health checks); each decode instance's receiver is unreachable."""
    lines = ["port = 0", "health_interval_s = 0.2", "index_silence_s = 2.0", extra, f"prefill = {json.dumps(prefill)}"]
    for u in decode:
        lines += ["[[decode]]", f'url = "{u}"', f'receiver = "{DEAD_RECEIVER}"']
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def router_file(tmp_path):
    started = []

    def start(path: Path) -> launch.Daemon:
        r = launch.start_router(tmp_path, config=path)
        started.append(r)
        return r

    try:
        yield start
    finally:
        for r in started:
            r.stop()


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def test_sighup_sends_requests_to_the_new_instances_and_drops_the_old_after_their_requests(
        upstreams, gated, router_file, tmp_path):  # noqa: F811 - pytest fixtures
    p1_url, _, _ = upstreams("prefill1")
    p2_url, p2, _ = upstreams("prefill2")
    d1_url, d1, gate = gated("decode1")
    d2_url, _, _ = upstreams("decode2")
    path = tmp_path / "router.toml"
    write(path, [p1_url], [d1_url])
    r = router_file(path)
    url = r.info["url"]
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("first", post(url, {"prompt": "abc", "max_tokens": 2})))
    t.start()
    try:
        assert d1.state["arrived"].wait(10), "the first request at decode1"
        write(path, [p2_url], [d2_url])
        os.kill(r.pid, signal.SIGHUP)
        until(lambda: set(health(url)["instances"]) == {f"prefill:{p2_url}", f"decode:{d2_url}"}, 10, "the new lists")
        # its request is still in flight (its prefill leg, where it went at once, ends and is dropped by then)
        until(lambda: health(url)["draining"] == {f"decode:{d1_url}": {"inflight": 1}}, 10, "decode1 draining")
        h = health(url)
        assert h["last_reload"].startswith(f"applied: prefill: +{p2_url}; -{p1_url}; 0 kept | decode: +{d2_url}")
        res = post(url, {"prompt": "abc", "max_tokens": 2})
        assert res.status_code == 200 and res.json()["choices"][0]["text"] == "decode2"
        assert res.headers["x-pdpush-prefill"] == p2_url
        # (both legs at once, the default where the prefill instance is idle: the answer may precede the prefill leg)
        until(lambda: [b for p, b in p2.seen if p == "/v1/completions"], 10, "the prefill leg at prefill2")
        m = httpx.get(url + "/metrics", timeout=10).text
        assert f'pdpush_router_instance_healthy{{instance="{d2_url}"}} 1.0' in m
        assert f'pdpush_router_inflight{{instance="{d1_url}"}} 1.0' in m and p1_url not in m
        assert 'pdpush_router_reloads_total{outcome="applied"} 1.0' in m
    finally:
        gate.set()
        t.join(30)
    first = out["first"]
    assert first.status_code == 200 and first.json()["choices"][0]["text"] == "decode1"  # finished where it was
    until(lambda: health(url)["draining"] == {}, 10, "decode1 dropped")
    assert d1_url not in httpx.get(url + "/metrics", timeout=10).text
    log = r.log()
    assert f"reload (SIGHUP) prefill: +{p2_url}; -{p1_url}" in log
    assert f"dropped decode:{d1_url}: no request in flight there any more" in log


def test_a_config_the_router_cannot_take_is_refused_and_the_old_instances_kept(upstreams, router_file, tmp_path):  # noqa: F811
    p_url, _, _ = upstreams("prefill")
    d1_url, d1, _ = upstreams("decode1")
    d2_url, _, _ = upstreams("decode2")
    path = tmp_path / "router.toml"
    write(path, [p_url], [d1_url])
    r = router_file(path)
    url = r.info["url"]

    def refused_after(n: int) -> str:
        os.kill(r.pid, signal.SIGHUP)
        until(lambda: f'pdpush_router_reloads_total{{outcome="refused"}} {n}.0' in
              httpx.get(url + "/metrics", timeout=10).text, 10, f"reload {n} refused")
        assert post(url, {"prompt": "abc"}).json()["choices"][0]["text"] == "decode1"  # the old list serves
        return health(url)["last_reload"]

    # an instance's state before: ejected once, then re-admitted
    d1.state["healthy"] = False
    until(lambda: health(url)["instances"][f"decode:{d1_url}"]["ejections"] == 1, 10, "decode1 ejected")
    d1.state["healthy"] = True
    until(lambda: health(url)["status"] == "ok", 10, "decode1 re-admitted")
    path.write_text("prefill = [")
    assert refused_after(1).startswith("refused: invalid RouterConfig")
    write(path, [p_url], [])
    assert "give at least one decode instance" in refused_after(2)
    write(path, [p_url], [d1_url, d1_url + "/"])
    assert refused_after(3) == f"refused: decode: {d1_url} is listed twice"
    assert "refused: decode:" in r.log() and set(health(url)["instances"]) == {f"prefill:{p_url}", f"decode:{d1_url}"}
    # a good one at last: decode2 added, decode1 kept with what the router knew of it; the policy waits for a restart
    write(path, [p_url], [d1_url, d2_url], extra='policy = "round_robin"')
    os.kill(r.pid, signal.SIGHUP)
    until(lambda: f"decode:{d2_url}" in health(url)["instances"], 10, "decode2 added")
    h = health(url)
    assert h["instances"][f"decode:{d1_url}"]["ejections"] == 1 and h["instances"][f"decode:{d2_url}"]["ejections"] == 0
    assert h["last_reload"].endswith("1 kept | changed, taking effect at the next start: policy")
    texts = {post(url, {"prompt": "abc"}).json()["choices"][0]["text"] for _ in range(4)}
    assert texts == {"decode1", "decode2"}


def test_a_decode_instance_added_by_sighup_has_its_receivers_index_followed(upstreams, router_file, tmp_path):  # noqa: F811
    p_url, _, _ = upstreams("prefill")
    d1_url, _, _ = upstreams("decode1")
    d2_url, _, _ = upstreams("decode2")
    path = tmp_path / "router.toml"
    write(path, [p_url], [d1_url])
    rx = launch.start_receiver(tmp_path, pool_pages=32, **LAY)
    tx = launch.start_sender(tmp_path, staging_bytes=8 << 20)
    try:
        push(tx, rx, "a", list(range(40)))  # 3 chunks held before the router hears of this receiver
        r = router_file(path)
        url = r.info["url"]
        rcv = rx.info["control_endpoint"]
        path.write_text(path.read_text() + f'[[decode]]\nurl = "{d2_url}"\nreceiver = "{rcv}"\n')
        os.kill(r.pid, signal.SIGHUP)
        until(lambda: health(url)["instances"].get(f"decode:{d2_url}", {}).get("index_chunks") == 3, 15,
              "the added receiver's snapshot")
        res = post(url, {"prompt": list(range(32)) + [999] * 5, "max_tokens": 1})  # 2 chunks held at decode2
        assert res.status_code == 200 and res.json()["choices"][0]["text"] == "decode2"
        assert f'pdpush_router_index_chunks{{receiver="{rcv}"}} 3.0' in httpx.get(url + "/metrics", timeout=10).text
        write(path, [p_url], [d1_url])  # dropped again: its feed ends, its series go
        os.kill(r.pid, signal.SIGHUP)
        until(lambda: rcv not in httpx.get(url + "/metrics", timeout=10).text, 10, "the receiver's series gone")
        assert set(health(url)["instances"]) == {f"prefill:{p_url}", f"decode:{d1_url}"}
    finally:
        tx.stop()
        rx.stop()


@pytest.mark.parametrize("bad", [
    {"prefill": ["127.0.0.1:8100"]},  # no scheme
    {"decode": [{"url": "http://d1:8200", "receiver": "127.0.0.1:5710"}]},
    {"decode": [{"url": "http://d1:8200", "receiver": "http://d1:5710"}]},
    {"decode": [{"url": "d1:8200", "receiver": "tcp://d1:5710"}]},
    {"kv_events": {A: {"endpoint": "tcp://*:5557"}}},  # vLLM's bind, copied: the router connects, to a host
    {"kv_events": {A: {"endpoint": "tcp://a:5557", "replay_endpoint": "a:5558"}}},
], ids=["prefill", "receiver", "receiver-http", "decode-url", "kv-bind", "kv-replay"])
def test_addresses_that_cannot_be_reached_are_refused_at_load_naming_the_field(bad):
    """An engine URL without its scheme, a receiver or KV-events endpoint that is not tcp://host:port: refused when
    the config is loaded, the field named (they were taken, and every request then failed or recomputed, or the
    router retried "cannot resolve '*'" every second for good)."""
    base = {"prefill": [A], "decode": [{"url": "http://d1:8200", "receiver": "tcp://d1:5710"}]}
    with pytest.raises(ConfigError) as e:
        cfgmod.load(RouterConfig, **{**base, **bad})
    assert next(iter(bad)) in str(e.value)


def test_brackets_in_an_endpoint_hold_an_ipv6_address_only():
    """``tcp://[1.2.3.4]:5710`` was taken, and the sender's start then died in urlsplit with a traceback."""
    assert cfgmod.endpoint_error("tcp://[::1]:5710") is None and cfgmod.endpoint_error("tcp://[::ffff:1.2.3.4]:1") is None
    for bad in ("tcp://[1.2.3.4]:5710", "tcp://[1:2]:5710", "tcp://[]:5710"):
        assert cfgmod.endpoint_error(bad), bad
