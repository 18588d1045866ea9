"""A model directory's KV layout, from its ``config.json`` (pure: reads JSON, imports no torch).

``pdpush layout --model DIR`` prints it as flat TOML for a receiver config, and a receiver config's
``model = DIR`` fills in the layout fields it does not set. Read: dense attention (MHA/GQA/MQA),
MLA (DeepSeek-V2/V3, Kimi K2: ``kv_lora_rank``), sliding-window layers beside full ones (Gemma 3,
gpt-oss: ``layer_types``), and recurrent-state layers beside attention or alone: Gated DeltaNet
(Qwen3-Next: ``linear_attention``) and Mamba2 (Nemotron-H's ``hybrid_override_pattern``, Granite 4's
``layer_types``, Mamba2 itself), whose conv and SSM state become the layout's state segments
(``state_of``). Other layer kinds are refused, naming them.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdpush.layout import DTYPES, KVLayout, dtype_name

DEFAULT_CHUNK_TOKENS = 256


class ModelConfigError(ValueError):
    """The model directory's config cannot be read as a layout pdpush moves."""


def _text_config(cfg: dict) -> dict:
    """Multimodal configs keep the language model's fields under ``text_config``."""
    tc = cfg.get("text_config") or cfg.get("language_config") or cfg
    if not isinstance(tc, dict):
        raise ModelConfigError(f"text_config is {type(tc).__name__}, not an object")
    return tc


# a model layer's kind: attention keeps KV (full or sliding), gdn/mamba2 keep recurrent state, none neither
_TYPES = {"full_attention": "full", "attention": "full", "sliding_attention": "sliding", "mlp": "none", "moe": "none"}
# what a model's state layers are ("linear_attention" is Gated DeltaNet in Qwen3-Next, Mamba2 in Nemotron-H)
_STATE_KIND = {"qwen3_next": "gdn", "qwen3_5": "gdn", "qwen3_5_text": "gdn", "nemotron_h": "mamba2",
               "granitemoehybrid": "mamba2", "mamba2": "mamba2"}
_STATE_NAMES = ("linear_attention", "mamba", "mamba2")
_PATTERN = {"*": "full", "M": "mamba2", "-": "none", "E": "none"}  # Nemotron-H's hybrid_override_pattern
_EVERY_PTH_FULL = {"gemma2": 2}  # sliding-window models whose configs say neither layer_types nor a pattern
ATTENTION = ("full", "sliding")
STATE = ("gdn", "mamba2")


def layer_kinds(cfg: dict, where: str = "model config", layers: int | None = None) -> list[str]:
    """Each model layer's kind (``full``, ``sliding``, ``gdn``, ``mamba2`` or ``none``), from a text config;
    a kind pdpush does not move is refused, naming it. ``layers``: the model's layer count where the config
    names it otherwise than ``num_hidden_layers`` (GPT-2's ``n_layer``: vLLM's count)."""
    if layers is not None and "num_hidden_layers" not in cfg:
        cfg = {**cfg, "num_hidden_layers": layers}
    if "num_hidden_layers" not in cfg and not isinstance(cfg.get("hybrid_override_pattern"), str) \
            and not isinstance(cfg.get("layer_types") or cfg.get("layers_block_type"), list):
        raise ModelConfigError(f"{where}: no num_hidden_layers")
    mt = str(cfg.get("model_type", ""))
    pattern = cfg.get("hybrid_override_pattern")
    types = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else cfg.get("layers_block_type")
    if isinstance(pattern, str) and not isinstance(types, list):
        bad = sorted(set(pattern) - set(_PATTERN))
        if bad:
            raise ModelConfigError(f"{where}: hybrid_override_pattern layer kinds {bad} are not ones pdpush moves")
        return [_PATTERN[c] for c in pattern]
    if mt == "mamba2":
        return ["mamba2"] * int(cfg["num_hidden_layers"])
    if mt in ("mamba", "jamba", "falcon_mamba") or (cfg.get("state_size") and not isinstance(types, list)):
        raise ModelConfigError(f"{where}: a {mt or 'state-space'} model, whose (Mamba 1) state pdpush does not move "
                               "(it moves attention, MLA, Gated DeltaNet and Mamba2 state)")
    if isinstance(types, list):
        kinds = {**_TYPES, **dict.fromkeys(_STATE_NAMES, _STATE_KIND.get(mt))}
        bad = sorted({str(t) for t in types if kinds.get(str(t)) is None})
        if bad:
            raise ModelConfigError(f"{where}: a hybrid model ({mt}, layer kinds {bad}) pdpush does not move; it moves "
                                   f"{sorted(_TYPES)} layers and the state of {sorted(_STATE_KIND)} models")
        if cfg.get("num_hidden_layers") is not None and len(types) != int(cfg["num_hidden_layers"]):
            raise ModelConfigError(f"{where}: {len(types)} layer kinds for {cfg['num_hidden_layers']} layers")
        return [kinds[str(t)] for t in types]
    n = int(cfg["num_hidden_layers"])
    w = cfg.get("sliding_window")
    if not w or not cfg.get("use_sliding_window", True):
        return ["full"] * n
    # no layer_types: every p-th layer full, the others sliding, as transformers reads these configs (Gemma 3,
    # Cohere2: ``sliding_window_pattern``; Gemma 2: every other layer); else one window for every layer (Mistral)
    p = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or _EVERY_PTH_FULL.get(mt)
    if p is not None and (not isinstance(p, int) or isinstance(p, bool) or p < 1):
        raise ModelConfigError(f"{where}: sliding_window_pattern {p!r} is not a positive integer")
    return ["sliding" if p is None or (i + 1) % p else "full" for i in range(n)]


def windows_of(cfg: dict, where: str = "model config", layers: int | None = None) -> tuple[int, ...]:
    """Each attention layer's sliding window (0: full attention), in order: ``layer_types`` with
    ``sliding_window`` (gpt-oss, Gemma 3 as transformers saves it), or without them the layers that
    ``sliding_window_pattern`` (Gemma 3, Cohere2) or the model (Gemma 2: every other one) makes sliding, or
    else one ``sliding_window`` for every layer where ``use_sliding_window`` is not off (Mistral 7B v0.1)."""
    kinds = [k for k in layer_kinds(cfg, where, layers) if k in ATTENTION]
    w = cfg.get("sliding_window")
    if "sliding" in kinds and not w:
        raise ModelConfigError(f"{where}: sliding_attention layers but no sliding_window")
    return tuple(int(w) if k == "sliding" else 0 for k in kinds) if "sliding" in kinds else ()


def _units(*counts: int) -> int:
    """State units: the largest of 8, 4, 2, 1 dividing every head (and group) count, so that any TP up to
    it splits the state into whole units."""
    return next(u for u in (8, 4, 2, 1) if all(c % u == 0 for c in counts))


def state_of(cfg: dict, dtype: str, ssm_dtype: str | None = None, where: str = "model config",
             layers: int | None = None) -> tuple[int, tuple, int]:
    """(state layers, segments, units) of a model's recurrent state, in the layout's terms: each engine
    tensor as vLLM keeps it per layer (conv ``[kernel - 1, channels]``, channels split by TP part by part;
    ssm split on its heads). Gated DeltaNet: conv = [q | k | v], ssm ``[v_heads, v_dim, k_dim]``; Mamba2:
    conv = [x | B | C] (B and C replicated where there is one group), ssm ``[heads, head_dim, state]``.
    ``ssm_dtype``: the SSM state's element type where the engine keeps it in another (default ``dtype``; for
    Gated DeltaNet float32, which vLLM keeps it in)."""
    kinds = layer_kinds(cfg, where, layers)
    state = sorted({k for k in kinds if k in STATE})
    if not state:
        return 0, (), 1
    if len(state) > 1:
        raise ModelConfigError(f"{where}: state layers of several kinds {state}")
    sdt = ssm_dtype or ("float32" if state[0] == "gdn" else dtype)
    try:
        if state[0] == "gdn":
            kh, vh = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
            kd, vd, k = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"]), int(cfg["linear_conv_kernel_dim"])
            segs = (("conv", dtype, (k - 1, kh * kd), 1, False), ("conv", dtype, (k - 1, kh * kd), 1, False),
                    ("conv", dtype, (k - 1, vh * vd), 1, False), ("ssm", sdt, (vh, vd, kd), 0, False))
            units = _units(kh, vh)
        else:
            heads = int(cfg.get("mamba_num_heads") or cfg["num_heads"])
            hd = int(cfg.get("mamba_head_dim") or cfg["head_dim"])
            st = int(cfg.get("ssm_state_size") or cfg["state_size"])
            groups, k = int(cfg.get("n_groups") or 1), int(cfg.get("conv_kernel") or 4)
            one = groups == 1
            segs = (("conv", dtype, (k - 1, heads * hd), 1, False), ("conv", dtype, (k - 1, groups * st), 1, one),
                    ("conv", dtype, (k - 1, groups * st), 1, one), ("ssm", sdt, (heads, hd, st), 0, False))
            units = _units(heads) if one else _units(heads, groups)
    except KeyError as e:
        raise ModelConfigError(f"{where}: no {e.args[0]!r} for its {state[0]} state layers") from None
    return sum(1 for x in kinds if x in STATE), segs, units


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
        windows = windows_of(tc, str(path))
        layers = sum(1 for k in layer_kinds(tc, str(path)) if k in ATTENTION)
        dt = dtype_name(dtype or tc.get("torch_dtype") or tc.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
        state_layers, state, units = state_of(tc, dt, tc.get("mamba_ssm_cache_dtype"), str(path))
        if tc.get("kv_lora_rank"):  # MLA: one latent of kv_lora_rank + qk_rope_head_dim per token
            kind, heads, head_dim = "mla", 1, int(tc["kv_lora_rank"]) + int(tc["qk_rope_head_dim"])
        elif not layers:  # state only (Mamba2): no KV
            kind, heads, head_dim = "mha", 1, 1
        else:
            heads = int(tc.get("num_key_value_heads") or tc["num_attention_heads"])
            head_dim = int(tc.get("head_dim") or int(tc["hidden_size"]) // int(tc["num_attention_heads"]))
            kind = "mha"
        return KVLayout(layers, heads, head_dim, dt, chunk_tokens or DEFAULT_CHUNK_TOKENS,  # type: ignore[arg-type]
                        model_id or Path(model_dir).resolve().name, kind=kind,  # type: ignore[arg-type]
                        kv_scales="static" if DTYPES[dt].bytes == 1 else "none",  # fp8: the checkpoint's scales
                        windows=windows, state_layers=state_layers, state=state, state_units=units)
    except KeyError as e:
        raise ModelConfigError(f"{path}: no {e.args[0]!r}: not a decoder config pdpush can read") from None
    except (TypeError, ValueError) as e:
        raise ModelConfigError(f"{path}: {e}") from None


def toml_lines(lay: KVLayout, *, chunk_tokens: bool = False, model_id: bool = False) -> str:
    """The layout the model decides, as flat TOML ``key = value`` lines, to append to a receiver config (the
    shipped ones end in top-level keys, so appended lines stay top-level). ``chunk_tokens`` and ``model_id`` are
    the deployment's choices, which a config sets already: printed only when asked for, or TOML would refuse
    the duplicate key."""
    skip = {k for k, asked in (("chunk_tokens", chunk_tokens), ("model_id", model_id)) if not asked}
    return "".join(f"{k} = {json.dumps(v)}\n" for k, v in lay.to_dict().items() if k not in skip)
