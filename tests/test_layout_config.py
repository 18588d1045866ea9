"""Layout arithmetic, chunk keys, configuration loading and the CLI's fast paths."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdpush import config as C
from pdpush import launch
from pdpush.config import ReceiverConfig, load
from pdpush.errors import ConfigError
from pdpush.layout import KVLayout, chunk_keys, runs
from pdpush.model_layout import ModelConfigError, layout_of, windows_of


def test_page_geometry():
    lay = KVLayout(80, 8, 128, "float16", 256)
    assert lay.token_bytes == 4096  # LLaMA-2-70B: 4 KiB per token per layer
    assert lay.page_bytes == 1 << 20
    assert lay.num_chunks(513) == 3 and lay.last_chunk_tokens(513) == 1 and lay.last_chunk_tokens(512) == 256


def test_chunk_keys_chain_and_layout_sensitivity():
    lay = KVLayout(2, 2, 64, "float16", 4)
    a = chunk_keys(list(range(10)), lay)
    b = chunk_keys(list(range(8)) + [99, 98], lay)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    c = chunk_keys([0, 1, 2, 99] + list(range(4, 10)), lay)
    assert c[0] != a[0] and c[1] != a[1]  # a change early in the prompt changes every later key
    other = KVLayout(2, 2, 64, "bfloat16", 4)
    assert chunk_keys(list(range(10)), other)[0] != a[0]
    assert all(len(k) == 16 for k in a)


def test_runs():
    assert runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert runs([]) == []


def test_bad_layout_rejected():
    with pytest.raises(ValueError, match="kv_heads"):
        KVLayout(2, 0, 64, "float16", 4)


def test_unknown_key_named(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('layers = 4\npool_pagez = 3\n')
    with pytest.raises(ConfigError, match="pool_pagez"):
        C.load(C.ReceiverConfig, f)


def test_bad_value_named(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('dtype = "int8"\n')
    with pytest.raises(ConfigError, match="dtype"):
        C.load(C.ReceiverConfig, f)


def test_precedence_cli_env_file(tmp_path, monkeypatch):
    f = tmp_path / "r.toml"
    f.write_text("layers = 4\nkv_heads = 2\npool_pages = 9\n")
    monkeypatch.setenv("PDPUSH_KV_HEADS", "3")
    monkeypatch.setenv("PDPUSH_POOL_PAGES", "10")
    cfg = C.load(C.ReceiverConfig, f, pool_pages=11)
    assert (cfg.layers, cfg.kv_heads, cfg.pool_pages) == (4, 3, 11)


def test_shipped_configs_load():
    r = C.load(C.ReceiverConfig, "configs/receiver.toml")
    s = C.load(C.SenderConfig, "configs/sender.toml")
    assert r.host == "127.0.0.1" and s.default_receiver == f"tcp://127.0.0.1:{r.control_port}"


def test_import_pdpush_does_not_import_torch_or_ucx():
    code = ("import sys, pdpush, pdpush.cli, pdpush.config, pdpush.protocol, pdpush.pool; "
            "bad = [m for m in ('torch', 'ucxx', 'transformers', 'pdpush_native._dataplane', 'pdpush.transport.ucp') "
            "if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_product_imports_no_tooling_module():
    """The CLI adds the tooling's commands from their signatures alone: no bench, demo or harness module loads,
    and nothing of the product imports the tooling (pdpush_tools)."""
    code = ("import sys, pdpush.cli, pdpush.sender, pdpush.receiver, pdpush.client, pdpush.transport.ucx; "
            "bad = [m for m in sys.modules if m.startswith('pdpush_tools') and m not in "
            "('pdpush_tools', 'pdpush_tools.cli', 'pdpush_tools.bench', 'pdpush_tools.bench.registry')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    product = Path(__file__).resolve().parents[1] / "pdpush"
    users = [str(p) for p in product.rglob("*.py") if "pdpush_tools" in p.read_text() and p.name != "cli.py"]
    assert not users, users


def test_bench_scenarios_come_from_one_registry():
    from typer.testing import CliRunner

    from pdpush.cli import app
    from pdpush_tools.bench.registry import SCENARIOS

    r = CliRunner().invoke(app, ["bench", "--scenario", "nope"])
    assert r.exit_code == 2 and ", ".join(SCENARIOS) in r.output


@pytest.mark.parametrize("role", ["receiver", "sender"])
def test_daemon_help(role):
    r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", role, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--config" in r.stdout and ("--bind" in r.stdout) == (role == "receiver")


def test_bad_config_exits_2_naming_field(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text("bogus_key = 1\n")
    r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "receiver", "--config", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "bogus_key" in r.stderr


def _model_dir(tmp_path, name: str, cfg: dict):
    import json

    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_pdpush_layout_reads_gqa_mla_and_refuses_hybrids(tmp_path):
    gqa = _model_dir(tmp_path, "llama", {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                          "hidden_size": 4096, "torch_dtype": "bfloat16"})
    assert layout_of(gqa) == KVLayout(32, 8, 128, "bfloat16", 256, "llama")
    kimi = _model_dir(tmp_path, "kimi", {"text_config": {"num_hidden_layers": 61, "num_attention_heads": 64,
                                                          "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                                          "hidden_size": 7168, "torch_dtype": "bfloat16"}})
    assert layout_of(kimi, chunk_tokens=64, dtype="fp8_e4m3") == KVLayout(61, 1, 576, "float8_e4m3fn", 64, "kimi",
                                                                          kind="mla", kv_scales="static")
    gemma = _model_dir(tmp_path, "gemma", {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
                                            "sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"]})
    assert layout_of(gemma).windows == (512, 0)  # sliding-window layers beside full ones: each its window
    nowin = _model_dir(tmp_path, "nowin", {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
                                            "layer_types": ["sliding_attention", "full_attention"]})
    with pytest.raises(ModelConfigError, match="no sliding_window"):
        layout_of(nowin)
    qnext = _model_dir(tmp_path, "qnext", {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
                                            "layer_types": ["linear_attention", "full_attention"]})
    with pytest.raises(ModelConfigError, match="linear_attention"):
        layout_of(qnext)
    out = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "layout", "--model", str(kimi), "--chunk-tokens",
                          "64"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rx = tmp_path / "receiver.toml"  # the printed lines, appended as they are, give the same layout
    rx.write_text("pool_pages = 4\n" + out.stdout)
    assert "model_id" not in out.stdout  # the deployment's choice: printed only when given
    assert load(ReceiverConfig, rx).layout == layout_of(kimi, chunk_tokens=64, model_id="default")
    bad = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "layout", "--model", str(qnext)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "hybrid model" in bad.stderr


@pytest.mark.parametrize("model_type, extra", [("gemma2", {}), ("gemma3_text", {"sliding_window_pattern": 6}),
                                               ("cohere2", {"sliding_window_pattern": 4}), ("mistral", {})])
def test_sliding_layers_of_a_config_without_layer_types_are_those_transformers_makes(model_type, extra):
    """Gemma 2, Gemma 3 and Cohere2 configs as published say no ``layer_types``: transformers makes every p-th
    layer full and the others sliding. Read as all sliding, the full layers' KV before the window was never
    pushed (a decode reading those layers would miss it)."""
    from transformers import AutoConfig

    cfg = {"model_type": model_type, "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 256, "head_dim": 64, "sliding_window": 512, **extra}
    theirs = AutoConfig.for_model(**cfg)
    want = tuple(512 if t == "sliding_attention" else 0 for t in getattr(theirs, "layer_types", None)
                 or ["sliding_attention"] * 12)
    assert windows_of(cfg) == want
    assert (0 in want) is (model_type != "mistral")  # (each has full layers but Mistral)


def test_a_receiver_config_takes_the_model_directory(tmp_path):
    d = _model_dir(tmp_path, "tiny", {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                                       "hidden_size": 256, "torch_dtype": "float32"})
    rx = tmp_path / "receiver.toml"
    rx.write_text(f'model = "{d}"\nchunk_tokens = 48\npool_pages = 8\npool_shards = 2\n')
    assert load(ReceiverConfig, rx).layout == KVLayout(4, 2, 64, "float32", 48, "tiny")
    rx.write_text(f'model = "{d}"\ndtype = "bfloat16"\nmodel_id = "served"\n')  # what is set wins
    assert load(ReceiverConfig, rx).layout == KVLayout(4, 2, 64, "bfloat16", 256, "served")
    rx.write_text(f'model = "{tmp_path / "missing"}"\n')
    with pytest.raises(ConfigError, match="cannot read the model's config"):
        load(ReceiverConfig, rx)


def test_a_hybrid_model_s_state_layers_become_the_layout_s_state(tmp_path):
    """Nemotron-H (Mamba2, as transformers writes its config: layers_block_type), Qwen3-Next (GDN) and Mamba2
    alone: their attention layers, and their conv and SSM state as state segments split into units."""
    from pdpush.model_layout import ModelConfigError, layout_of

    nh = _model_dir(tmp_path, "nh", {"model_type": "nemotron_h", "layers_block_type": ["mamba", "mlp", "attention", "mlp"],
                                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                                      "hidden_size": 256, "mamba_num_heads": 8, "mamba_head_dim": 32,
                                      "ssm_state_size": 16, "n_groups": 1, "conv_kernel": 4, "torch_dtype": "float32"})
    lay = layout_of(nh, chunk_tokens=48)
    assert (lay.layers, lay.kv_heads, lay.state_layers, lay.state_units) == (1, 2, 1, 8)
    assert [(s.tensor, s.shape, s.replicated) for s in lay.state] == [
        ("conv", (3, 256), False), ("conv", (3, 16), True), ("conv", (3, 16), True), ("ssm", (8, 32, 16), False)]
    q3 = _model_dir(tmp_path, "q3", {"model_type": "qwen3_next", "num_hidden_layers": 4, "num_attention_heads": 4,
                                      "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 256,
                                      "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                                      "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128,
                                      "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                                      "torch_dtype": "bfloat16"})
    lay = layout_of(q3)
    assert (lay.layers, lay.state_layers, lay.state_units) == (1, 3, 2)  # two key heads: TP 2 splits the state
    assert lay.state[-1].dtype == "float32" and lay.state[-1].shape == (4, 128, 128)  # vLLM keeps GDN's SSM in fp32
    m2 = _model_dir(tmp_path, "m2", {"model_type": "mamba2", "num_hidden_layers": 2, "hidden_size": 256, "num_heads": 8,
                                      "head_dim": 32, "state_size": 16, "n_groups": 1, "conv_kernel": 4})
    assert (layout_of(m2).layers, layout_of(m2).state_layers) == (0, 2)
    jamba = _model_dir(tmp_path, "jamba", {"model_type": "jamba", "num_hidden_layers": 2, "hidden_size": 256,
                                            "num_attention_heads": 4, "layers_block_type": ["mamba", "attention"]})
    with pytest.raises(ModelConfigError, match="jamba"):
        layout_of(jamba)


def test_layout_appended_to_the_shipped_receiver_config_starts_a_receiver_for_that_model(tmp_path):
    """`pdpush layout --model DIR >> receiver.toml` on a copy of configs/receiver.toml: the shipped file ends in
    top-level keys, the output sets neither chunk_tokens nor model_id (which the file sets), and the receiver
    it starts serves the model's layout."""
    d = _model_dir(tmp_path, "tiny", {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                                       "hidden_size": 256, "torch_dtype": "float32"})
    out = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "layout", "--model", str(d)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "chunk_tokens" not in out.stdout and "model_id" not in out.stdout, out.stdout
    cfg = tmp_path / "receiver.toml"
    cfg.write_text((Path(__file__).resolve().parents[1] / "configs/receiver.toml").read_text() + out.stdout)
    want = layout_of(d, model_id="default")
    assert load(ReceiverConfig, cfg).layout == want
    rx = launch.start_receiver(tmp_path, config=cfg, control_port=0, ucx_port=0, metrics_port=0, prefault=False,
                               local_socket=str(tmp_path / "rx.sock"), pool_pages=4)
    try:
        assert rx.info["fingerprint"] == want.fingerprint()
    finally:
        rx.stop()


def test_a_layout_the_protocol_cannot_carry_or_a_socket_path_too_long_fails_at_load():
    """Each started, then failed after the pool was allocated, with a traceback: a layout with more layers than a
    HelloAck carries, and a local socket whose lifeline path is past the 107 bytes a unix socket takes."""
    from pdpush import config as C

    with pytest.raises(C.ConfigError, match="outside what the protocol carries"):
        C.load(C.ReceiverConfig, layers=5000)
    long = "/tmp/" + "x" * 100 + ".sock"
    with pytest.raises(C.ConfigError, match="107"):
        C.load(C.ReceiverConfig, local_socket=long)
    with pytest.raises(C.ConfigError, match="107"):
        C.load(C.SenderConfig, ingress_socket=long)
