"""A model directory's KV layout, from its ``config.json`` (pure: reads JSON, imports no torch).

``pdpush layout --model DIR`` prints it as flat TOML for a receiver config, and a receiver config's
``model = DIR`` fills in the layout fields it does not set. Dense attention (MHA/GQA/MQA), MLA
(DeepSeek-V2/V3, Kimi K2: ``kv_lora_rank``) and sliding-window layers beside full ones (Gemma 3,
gpt-oss: ``layer_types``, ``windows_of``) are read; linear-attention and state-space layers (GDN,
Mamba2) are refused, naming their layer kinds: pdpush does not move their state yet.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdpush.layout import DTYPES, KVLayout, dtype_name

DEFAULT_CHUNK_TOKENS = 256
_HYBRID_KEYS = ("layer_types", "layers_block_type", "hybrid_override_pattern", "block_types")


class ModelConfigError(ValueError):
    """The model directory's config cannot be read as a layout pdpush moves."""


def _text_config(cfg: dict) -> dict:
    """Multimodal configs keep the language model's fields under ``text_config``."""
    tc = cfg.get("text_config") or cfg.get("language_config") or cfg
    if not isinstance(tc, dict):
        raise ModelConfigError(f"text_config is {type(tc).__name__}, not an object")
    return tc


_ATTENTION = {"full_attention", "attention", "sliding_attention"}


def _refuse_hybrids(cfg: dict, where: str) -> None:
    """Layers that keep state instead of KV (linear attention, Mamba): refused, naming their kinds."""
    kinds: set[str] = set()
    for key in _HYBRID_KEYS:
        v = cfg.get(key)
        if isinstance(v, list):
            kinds.update(str(x) for x in v)
        elif isinstance(v, str):
            kinds.update(f"{key}:{c}" for c in sorted(set(v)))
    kinds -= _ATTENTION
    if "mamba" in str(cfg.get("model_type", "")) or cfg.get("ssm_state_size") or cfg.get("state_size"):
        kinds.add("mamba")
    if kinds:
        raise ModelConfigError(f"{where}: a hybrid model (layer kinds {sorted(kinds)}); pdpush moves attention "
                               "(full and sliding-window) and MLA only so far, not recurrent state")


def windows_of(cfg: dict, layers: int, where: str = "model config") -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), from a text config: ``layer_types`` with
    ``sliding_window`` (Gemma 3, gpt-oss), or one ``sliding_window`` for every layer where no
    ``layer_types`` says otherwise and ``use_sliding_window`` is not off (Mistral 7B v0.1)."""
    _refuse_hybrids(cfg, where)
    w = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if isinstance(types, list):
        if len(types) != layers:
            raise ModelConfigError(f"{where}: {len(types)} layer_types for {layers} layers")
        if "sliding_attention" in types and not w:
            raise ModelConfigError(f"{where}: sliding_attention layers but no sliding_window")
        return tuple(int(w) if t == "sliding_attention" else 0 for t in types)
    if w and cfg.get("use_sliding_window", True):
        return (int(w),) * layers
    return ()


def layout_of(model_dir: str | Path, *, chunk_tokens: int | None = None, dtype: str | None = None,
              model_id: str | None = None) -> KVLayout:
    """The layout of the model in ``model_dir``, served in ``dtype`` (default: the config's)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"{path}: cannot read the model's config: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{path}: not a JSON object")
    tc = _text_config(cfg)
    try:
        layers = int(tc["num_hidden_layers"])
        windows = windows_of(tc, layers, str(path))
        dt = dtype_name(dtype or tc.get("torch_dtype") or tc.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
        if tc.get("kv_lora_rank"):  # MLA: one latent of kv_lora_rank + qk_rope_head_dim per token
            kind, heads, head_dim = "mla", 1, int(tc["kv_lora_rank"]) + int(tc["qk_rope_head_dim"])
        else:
            heads = int(tc.get("num_key_value_heads") or tc["num_attention_heads"])
            head_dim = int(tc.get("head_dim") or int(tc["hidden_size"]) // int(tc["num_attention_heads"]))
            kind = "mha"
        return KVLayout(layers, heads, head_dim, dt, chunk_tokens or DEFAULT_CHUNK_TOKENS,  # type: ignore[arg-type]
                        model_id or Path(model_dir).resolve().name, kind=kind,  # type: ignore[arg-type]
                        kv_scales="static" if DTYPES[dt].bytes == 1 else "none",  # fp8: the checkpoint's scales
                        windows=windows)
    except KeyError as e:
        raise ModelConfigError(f"{path}: no {e.args[0]!r}: not a decoder config pdpush can read") from None
    except (TypeError, ValueError) as e:
        raise ModelConfigError(f"{path}: {e}") from None


def toml_lines(lay: KVLayout) -> str:
    """The layout as flat TOML ``key = value`` lines, to append to a receiver config."""
    out = []
    for k, v in lay.to_dict().items():
        out.append(f"{k} = {json.dumps(v)}")
    return "\n".join(out) + "\n"
