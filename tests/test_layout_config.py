"""Layout arithmetic, chunk keys, configuration loading and the CLI's fast paths."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdpush import config as C
from pdpush.errors import ConfigError
from pdpush.layout import KVLayout, chunk_keys, runs


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


def test_import_pdpush_does_not_import_torch_or_ucxx():
    code = ("import sys, pdpush, pdpush.cli, pdpush.config, pdpush.protocol, pdpush.pool; "
            "bad = [m for m in ('torch', 'ucxx', 'transformers') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("role", ["receiver", "sender"])
def test_daemon_help(role):
    r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", role, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--config" in r.stdout and "--bind" in r.stdout


def test_bad_config_exits_2_naming_field(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text("bogus_key = 1\n")
    r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "receiver", "--config", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "bogus_key" in r.stderr
