"""A real transformers model, prefill and decode in separate processes, real daemons in between."""

from __future__ import annotations

import numpy as np
import pytest

from pdpush.integrations.transformers import ModelSpec
from pdpush_tools.demo import run as demo

SMALL = dict(layers=4, hidden=128, heads=4, kv_heads=2, prompt_tokens=200, new_tokens=8, chunk_tokens=16,
             layer_compute_ms=30.0)


def test_fp32_exact_logits_pipelined_eager_and_prefix_reuse():
    res = demo.run_demo(dtype="float32", **SMALL)
    # 200 tokens = 12.5 chunks of 16: the last chunk is partial
    assert res["per_request_match"] == {n: {"tokens": True, "logits": True} for n in ("eager", "pipelined", "second")}
    assert res["tokens_match"] and res["logits_match"]
    assert len(set(res["reference_tokens"])) > 2  # the model does not just repeat one token
    # prefix reuse: 150 shared tokens = 9 full chunks held; only the rest moved
    assert res["already_sent_indexes_second"] == list(range(9))
    assert res["chunks_skipped_second"] == res["expected_chunks_skipped_second"] == 9
    assert demo.failures(res) == []
    # what the demo's exit status says: each promise it did not keep fails it (it used to look at the tokens alone)
    assert demo.failures({**res, "logits_match": False}) and demo.failures({**res, "chunks_skipped_second": 0})
    assert demo.failures({**res, "tokens_match": False})
    assert demo.failures({**res, "bytes_sent": {**res["bytes_sent"], "second": res["bytes_full_request"]}})
    page = 16 * 2 * 2 * 32 * 4
    assert res["bytes_sent"]["first"] == 4 * 13 * page and res["bytes_sent"]["second"] == 4 * 4 * page
    # pipelining, by event order: layer l is on the receiver before prefill finishes layer l+2
    ends, arrivals = res["pipelined_layer_end"], res["pipelined_layer_arrival"]
    assert len(ends) == len(arrivals) == 4
    for layer in range(2):
        assert arrivals[layer] < ends[layer + 2], (layer, arrivals, ends)


def test_device_copy_path_with_a_completion_thread_gives_exact_logits():
    """The GPU path's staging order and completion-thread hand-over, run on the CPU (no GPU here):
    exact logits for eager, pipelined and prefix reuse, and each layer handed over during the forward."""
    res = demo.run_demo(dtype="float32", handover="thread", **SMALL)
    assert res["handover"] == "thread"
    assert res["per_request_match"] == {n: {"tokens": True, "logits": True} for n in ("eager", "pipelined", "second")}
    assert res["chunks_skipped_second"] == 9
    ends, arrivals = res["pipelined_layer_end"], res["pipelined_layer_arrival"]
    for layer in range(2):
        assert arrivals[layer] < ends[layer + 2], (layer, arrivals, ends)


def test_bf16_one_shot_tokens_match():
    res = demo.run_demo(dtype="bfloat16", **SMALL)
    assert res["per_request_match"]["eager"]["tokens"] and res["per_request_match"]["pipelined"]["tokens"]


def test_decode_really_uses_the_pushed_kv(tmp_path):
    """Negative control: flipping bytes in the pool changes the decode output."""
    spec = ModelSpec(layers=2, hidden=128, heads=4, kv_heads=2, dtype="float32")
    prompt = list(range(3, 60))
    ref_tokens, ref_logits = demo.reference(spec, [prompt], 6)[0]
    cluster = demo.Cluster(spec, 16, tmp_path, pool_pages=16, staging_bytes=8 << 20)
    try:
        cluster.decode.call({"cmd": "open", "req_id": "c"})
        p = cluster.prefill.call({"cmd": "prefill", "req_id": "c", "prompt": prompt, "pipelined": True})
        cluster.decode.call({"cmd": "corrupt", "req_id": "c", "layer": 1})
        d = cluster.decode.call({"cmd": "decode", "req_id": "c", "first_token": p["first_token"], "steps": 5})
    finally:
        cluster.close()
    got = [demo._logits(x) for x in d["logits"]]
    assert p["first_token"] == ref_tokens[0]
    assert not all(np.array_equal(a, b) for a, b in zip(ref_logits[1:], got, strict=True))


@pytest.mark.parametrize("flag", ["--help"])
def test_demo_cli_help(flag):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "demo", flag], capture_output=True, text=True)
    assert r.returncode == 0 and "--layer-compute-ms" in r.stdout


def test_demo_against_running_daemons(tmp_path):
    """What the compose `demo` service does: the demo uses daemons someone else started."""

    from pdpush import launch
    from pdpush_tools.harness.ports import free_ports

    spec = ModelSpec(layers=2, hidden=128, heads=4, kv_heads=2, dtype="float32")
    lay = spec.layout(16)
    ports = free_ports(2)
    rx_cfg, tx_cfg = tmp_path / "rx.toml", tmp_path / "tx.toml"
    rx_cfg.write_text(f'control_port = {ports[0]}\nucx_port = {ports[1]}\nlocal_socket = "{tmp_path}/rx.sock"\n'
                      f'model_id = "{lay.model_id}"\nlayers = 2\nkv_heads = 2\nhead_dim = 32\ndtype = "float32"\n'
                      f'chunk_tokens = 16\npool_pages = 64\nprefault = false\nmetrics_port = -1\n')
    tx_cfg.write_text(f'ingress_socket = "{tmp_path}/tx.sock"\nstaging_bytes = 16777216\nprefault = false\n'
                      f'default_receiver = "tcp://127.0.0.1:{ports[0]}"\nmetrics_port = -1\n')
    rx = launch.start_receiver(tmp_path, config=rx_cfg)
    tx = launch.start_sender(tmp_path, config=tx_cfg)
    try:
        res = demo.run_demo(layers=2, hidden=128, heads=4, kv_heads=2, prompt_tokens=90, new_tokens=4,
                            chunk_tokens=16, layer_compute_ms=5.0, receiver_config=rx_cfg, sender_config=tx_cfg)
        assert res["tokens_match"] and res["logits_match"] and res["chunks_skipped_second"] == 4
        with pytest.raises(Exception, match="demo model needs"):  # a layout the receiver does not serve
            demo.run_demo(layers=3, hidden=128, heads=4, kv_heads=2, prompt_tokens=90, new_tokens=4,
                          chunk_tokens=16, receiver_config=rx_cfg, sender_config=tx_cfg)
    finally:
        tx.stop()
        rx.stop()
