"""``make gpu-check``: pdpush's GPU path on a real GPU, as one script of a few minutes, one JSON file.

1. Staging microbenchmark (in this process): device-to-host GB/s into page-locked staging (a SysV
   segment like the sender's, pinned with cudaHostRegister, copied on a side stream) against
   ``tensor.to("cpu")``; host-to-device from the pinned pool against pageable memory; and how much of
   a pinned copy on a side stream overlaps a matrix-multiply loop on the compute stream.
2. The demo on the GPU (real daemons, real UCX, a prefill and a decode engine process): eager, and
   pipelined with the completion thread and with polling. For each: token (and logit) equality with
   colocated generation on the same GPU, exposed transfer, and the prefill forward's time with the
   push on against the same forward with no push, interleaved, medians (the push must not slow the
   forward by more than 5 %).
3. ``pdpush demo --device cuda`` itself, with its default model (token and logit equality).
4. fp8 caches: float8 KV (e4m3 GQA, e5m2 MLA latent split between 2 prefill ranks) in CUDA tensors
   pushed through the device stager and the real daemons, loaded back to the device on the decode
   side, byte for byte.

``--device cpu --small`` runs the same script on the CPU with a tiny model (``tests/test_gpu_check``
keeps it from rotting where no GPU is). Everything is written to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from pdpush_tools.bench.report import save

# An 8B-class layer (Llama-3-8B's shapes, 16 of its 32 layers): the forward is GPU-bound, as in serving,
# so that what the push costs the forward is measured, not the host's kernel-launch rate.
GPU_SPEC = dict(layers=16, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=32000, dtype="bfloat16")
SMALL_SPEC = dict(layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=1000, dtype="float32")


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def environment(device: str) -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "device": device,
           "cuda_available": torch.cuda.is_available(), "host_cpus": os.cpu_count()}
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(torch.device(device))
        out.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda,
                   capability=f"{p.major}.{p.minor}")
    try:
        from pdpush import doctor

        facts = doctor.gather()
        out["ucx"] = {k: facts["ucx"][k] for k in ("version", "library", "source", "transports")}
        out["rdma_capable"] = facts["rdma_capable"]
        out["ucx_cuda"] = facts["cuda"]
    except Exception as e:  # noqa: BLE001 - reported, the demo part will fail with its own error
        out["ucx"] = f"not loadable: {type(e).__name__}: {e}"
    return out


# ------------------------------------------------------------------------------ staging microbench

def staging_bench(device: str, nbytes: int, repeats: int) -> dict:
    import torch

    from pdpush import shm

    cuda = device.startswith("cuda")
    dev = torch.device(device)
    shmid, addr = shm.create_private(nbytes)
    try:
        shm.prefault(addr, nbytes)
        pinned = shm.pin_if_cuda(addr, nbytes) if cuda else False
        host = torch.from_numpy(shm.array_at(addr, nbytes))
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
        out: dict = {"bytes": nbytes, "pinned": pinned, "host_view_is_pinned": bool(cuda and host.is_pinned())}

        def gbps(seconds: list[float]) -> float:
            return round(nbytes / statistics.median(seconds) / 1e9, 2)

        if not cuda:  # the CPU dry run: the same shape of numbers, with memcpy standing in
            t = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                host.copy_(src)
                t.append(time.perf_counter() - t0)
            out.update(d2h_pinned_gbps=gbps(t), d2h_to_cpu_gbps=None, h2d_pinned_gbps=None, h2d_pageable_gbps=None,
                       bytes_equal=bool(torch.equal(host, src)), overlap=None)
            return out
        side = torch.cuda.Stream(dev)

        def timed(fn, stream) -> float:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                s.record(stream)
                fn()
                e.record(stream)
            e.synchronize()
            return s.elapsed_time(e) / 1000

        d2h_pinned = [timed(lambda: host.copy_(src, non_blocking=True), side) for _ in range(repeats + 1)][1:]
        torch.cuda.synchronize()
        equal = bool(torch.equal(host, src.cpu()))
        to_cpu = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            x = src.to("cpu")  # what the engine did before: a fresh pageable tensor, synchronous
            to_cpu.append(time.perf_counter() - t0)
            del x
        to_cpu = to_cpu[1:]
        dst = torch.empty_like(src)
        pageable = torch.from_numpy(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
        h2d_pinned = [timed(lambda: dst.copy_(host, non_blocking=True), side) for _ in range(repeats + 1)][1:]
        h2d_pageable = [timed(lambda: dst.copy_(pageable, non_blocking=True), side) for _ in range(repeats + 1)][1:]
        out.update(d2h_pinned_gbps=gbps(d2h_pinned), d2h_to_cpu_gbps=gbps(to_cpu), h2d_pinned_gbps=gbps(h2d_pinned),
                   h2d_pageable_gbps=gbps(h2d_pageable), bytes_equal=equal,
                   d2h_speedup_vs_to_cpu=round(statistics.median(to_cpu) / statistics.median(d2h_pinned), 2))
        out["overlap"] = _overlap(dev, side, host, src, repeats)
        if pinned:
            shm.unpin_cuda(addr)
        return out
    finally:
        shm.detach(addr)


def _overlap(dev, side, host, src, repeats: int) -> dict:
    """A pinned copy on the side stream against a matmul loop on the compute stream: each alone,
    then both at once. overlap = (compute + copy - both) / min(compute, copy): 1 is full overlap."""
    import torch

    main = torch.cuda.current_stream(dev)
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=dev)

    def mm(n):
        for _ in range(n):
            a @ a

    def run(compute: int, copy: bool) -> float:
        torch.cuda.synchronize()
        s, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        s.record(main)
        side.wait_event(s)
        if copy:
            with torch.cuda.stream(side):
                host.copy_(src, non_blocking=True)
        e2.record(side)
        if compute:
            mm(compute)
        e1.record(main)
        torch.cuda.synchronize()
        return max(s.elapsed_time(e1), s.elapsed_time(e2)) / 1000

    copy_s = statistics.median(run(0, True) for _ in range(repeats))
    one = statistics.median(run(1, False) for _ in range(repeats))
    n = max(1, round(copy_s / one))  # about as long as the copy
    comp_s = statistics.median(run(n, False) for _ in range(repeats))
    both_s = statistics.median(run(n, True) for _ in range(repeats))
    return {"copy_ms": round(copy_s * 1000, 3), "compute_ms": round(comp_s * 1000, 3), "both_ms": round(both_s * 1000, 3),
            "overlap": round((comp_s + copy_s - both_s) / min(comp_s, copy_s), 3)}


# ------------------------------------------------------------------------------ the demo on the device

def demo_check(device: str, spec_kw: dict, prompt_tokens: int, chunk_tokens: int, new_tokens: int, repeats: int,
               say) -> dict:
    from pdpush import launch
    from pdpush.integrations.transformers import ModelSpec
    from pdpush.staging import ahead_bytes
    from pdpush_tools.demo import run as demo

    spec = ModelSpec(**spec_kw)
    lay = spec.layout(chunk_tokens)
    rng = np.random.default_rng(7)
    chunks = lay.num_chunks(prompt_tokens)
    modes = [("eager", False, None), ("pipelined_thread", True, "thread"), ("pipelined_poll", True, "poll")]
    checked = {name: rng.integers(0, spec.vocab, prompt_tokens).tolist() for name, _, _ in modes}
    say(f"model {spec.model_id} ({spec.dtype}) on {device}: KV {lay.token_bytes * prompt_tokens / 2**20:.1f} MiB "
        f"per layer, {lay.layers} layers, {chunks} chunks of {chunk_tokens}")
    workdir = launch.scratch_dir("pdpush-gpu-check-")
    t0 = time.monotonic()
    cluster = demo.Cluster(spec, chunk_tokens, workdir, pool_pages=chunks * 4,
                           staging_bytes=ahead_bytes(chunks * lay.page_bytes, lay.layers), device=device)
    out: dict = {"model": spec.model_id, "spec": spec_kw, "prompt_tokens": prompt_tokens, "chunk_tokens": chunk_tokens,
                 "kv_bytes_per_request": lay.layers * chunks * lay.page_bytes, "repeats": repeats}
    try:
        out["start_s"] = round(time.monotonic() - t0, 1)
        say("colocated reference on the same device")
        refs = dict(zip(checked, demo.reference(spec, list(checked.values()), new_tokens, device), strict=True))
        say("warm-up")
        for i, (_, pipelined, mode) in enumerate(modes):
            cluster.run(f"warm-{i}", rng.integers(0, spec.vocab, prompt_tokens).tolist(), 2, pipelined, 0.0, mode)
        cluster.prefill.call({"cmd": "forward", "prompt": rng.integers(0, spec.vocab, prompt_tokens).tolist()})
        res: dict = {}
        for name, pipelined, mode in modes:
            got = cluster.run(f"check-{name}", checked[name], new_tokens, pipelined, 0.0, mode)
            tokens_ok, logits_ok = demo.compare(refs[name], got)
            res[name] = {"handover": got["prefill"]["handover_mode"], "tokens_match": tokens_ok,
                         "logits_match": logits_ok, "distinct_tokens": len(set(got["tokens"])),
                         "forward_ms": [], "exposed_transfer_ms": [], "ttft_ms": [],
                         "handed_over_after_layer_end_ms": [], "bytes_sent": got["prefill"]["bytes_sent"]}
        off: list[float] = []
        say(f"forward with the push on and off, {repeats} fresh prompts each, interleaved")
        for i in range(repeats):
            prompt = rng.integers(0, spec.vocab, prompt_tokens).tolist()
            off.append(cluster.prefill.call({"cmd": "forward", "prompt": prompt})["forward_s"] * 1000)
            for name, pipelined, mode in modes:
                got = cluster.run(f"rep-{name}-{i}", rng.integers(0, spec.vocab, prompt_tokens).tolist(), 2,
                                  pipelined, 0.0, mode)
                r = res[name]
                r["forward_ms"].append(got["forward_ms"])
                r["exposed_transfer_ms"].append(got["exposed_transfer_raw_ms"])
                r["ttft_ms"].append(got["ttft_ms"])
                ends, handed = got["prefill"]["layer_end"], got["prefill"]["handed_over"]
                # a layer's compute end -> its hand-over to the sender (below zero: K/V exist mid-layer, and
                # the copy finished before the layer's attention and MLP did)
                if len(ends) == len(handed) and pipelined:
                    lag = [(h - e) * 1000 for e, h in zip(ends, handed, strict=True)]
                    r["handed_over_after_layer_end_ms"].append(_median(lag))
        base = _median(off)
        out["forward_push_off_ms"] = {"median": base, "all": off}
        for r in res.values():
            fwd = _median(r["forward_ms"])
            r["forward_ms"] = {"median": fwd, "all": r["forward_ms"]}
            r["slowdown"] = round(fwd / base - 1, 4) if base else None
            r["slowdown_ok"] = r["slowdown"] is not None and r["slowdown"] <= 0.05
            for k in ("exposed_transfer_ms", "ttft_ms", "handed_over_after_layer_end_ms"):
                r[k] = {"median": _median(r[k]), "all": r[k]}
        out["modes"] = res
        out["tokens_match"] = all(r["tokens_match"] for r in res.values())
    finally:
        cluster.close()
    return out


FP8_CASES = [  # (layout fields, prefill TP = pool shards)
    (dict(layers=4, kv_heads=8, head_dim=128, dtype="float8_e4m3fn", chunk_tokens=64, kv_scales="static"), 1),
    (dict(layers=4, kv_heads=1, head_dim=576, dtype="float8_e5m2", chunk_tokens=64, kind="mla",
          kv_scales="static"), 2),
]


def _release_order(fences: list) -> dict:
    """The worker's release of a loaded request (``CopyHolds``, issue 34 item 3) with the copies just started: it
    must come only once every copy from the pool's pages has completed, never before, with no host wait on the
    engine's stream. ``held_at_first`` says whether a copy was still running when the release was first asked."""
    from pdpush.integrations.device_copy import CopyHolds

    seen: dict = {}

    class Probe:  # stands for the request: records what was true when it was released
        req_id = "fp8"

        def release(self):
            seen["copies_done_at_release"] = all(f is None or f.query() for f in fences)

    holds = CopyHolds()
    holds.release(Probe(), fences, lambda r, e: None)
    held = len(holds)
    holds.drain(lambda r, e: None)
    return {"release_held_at_first": bool(held), "release_after_copies": seen.get("copies_done_at_release", False)}


def fp8_check(device: str, tokens: int = 300) -> dict:
    """fp8 KV from device tensors through D2HStager and the real daemons, back to the device (H2DLoader)."""
    import torch

    from pdpush import launch
    from pdpush.client import DecodeClient, PrefillClient
    from pdpush.integrations.device_copy import D2HStager, H2DLoader
    from pdpush.layout import KVLayout

    cuda = device.startswith("cuda")
    cases = []
    for fields, tp in FP8_CASES:
        lay = KVLayout(**fields)
        wd = launch.scratch_dir("pdpush-fp8-")
        rx = tx = None
        clients: list = []
        dc = stager = None
        t0 = time.monotonic()
        try:
            rx = launch.start_receiver(wd, pool_pages=lay.num_chunks(tokens) + 4, prefault=False, pool_shards=tp,
                                       **lay.to_dict())
            tx = launch.start_sender(wd, staging_bytes=64 << 20, prefault=False)
            tx_sock = tx.info["ingress_endpoint"].removeprefix("ipc://")
            clients = [PrefillClient(lay, tx_sock, receiver=rx.info["control_endpoint"], timeout_s=60, pin_cuda=cuda)
                       for _ in range(tp)]
            dc = DecodeClient(rx.info["local_endpoint"].removeprefix("ipc://"), timeout_s=60, pin_cuda=cuda)
            stager = D2HStager(device, mode="thread" if cuda else "poll", timeout_s=60)
            g = torch.Generator(device="cpu").manual_seed(11)
            dt = getattr(torch, lay.dtype)
            comps = [torch.randint(0, 256, (lay.layers, tokens, lay.kv_heads, lay.row_bytes), generator=g,
                                   dtype=torch.uint8).to(device).view(dt) for _ in range(lay.components)]
            handles = [pc.begin("fp8", list(range(tokens)), tp_rank=r, tp_size=tp) for r, pc in enumerate(clients)]
            for layer in range(lay.layers):
                for h in handles:
                    stager.put_layer(h, layer, *(c[layer] for c in comps))
            for h in handles:
                stager.wait(h, 60)
                h.finish_nowait()
            dones = [h.poll_done(60) for h in handles]
            loader = H2DLoader(device)
            equal = None not in dones
            fences: list = []
            with dc.open("fp8", timeout_s=60) as req:
                for layer in range(lay.layers):
                    ticket = loader.start(req, layer, 60)
                    fences.append(loader.fence_of(ticket))
                    got = loader.finish(ticket, tokens, lay.dtype)
                    equal = equal and all(x.dtype == dt and torch.equal(x.view(torch.uint8), c[layer].view(torch.uint8))
                                          for x, c in zip(got, comps, strict=True))
                order = _release_order(fences)
            cases.append({"layout": lay.to_dict(), "prefill_tp": tp, "bytes_equal": bool(equal), **order,
                          "bytes_pushed": sum(d.bytes_sent for d in dones if d) // max(1, tp),
                          "seconds": round(time.monotonic() - t0, 2)})
        except Exception as e:  # noqa: BLE001 - reported in the case
            cases.append({"layout": lay.to_dict(), "prefill_tp": tp, "bytes_equal": False,
                          "error": f"{type(e).__name__}: {e}"})
        finally:
            if stager is not None:
                stager.close()
            for pc in clients:
                pc.close()
            if dc is not None:
                dc.close()
            for d in (tx, rx):
                if d is not None:
                    d.stop()
    return {"cases": cases, "bytes_equal": all(c["bytes_equal"] for c in cases),
            "release_after_copies": all(c.get("release_after_copies", False) for c in cases)}


def cli_demo(device: str, json_path: Path, timeout_s: float = 300) -> dict:
    """``pdpush demo`` itself, as a user runs it, on the device (real compute: no emulated layer time)."""
    import subprocess

    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "demo", "--device", device, "--layer-compute-ms",
                        "0", "--json", str(json_path)], capture_output=True, text=True, timeout=timeout_s)
    out: dict = {"rc": r.returncode, "seconds": round(time.monotonic() - t0, 1)}
    if json_path.exists():
        d = json.loads(json_path.read_text())
        out.update({k: d[k] for k in ("model", "device", "handover", "tokens_match", "logits_match",
                                      "per_request_match", "prefill_ms", "exposed_transfer_ms", "ttft_ms",
                                      "chunks_skipped_second")})
    else:
        out["stderr"] = r.stderr[-3000:]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a tiny model and buffers (the CPU dry run)")
    ap.add_argument("--prompt-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    a = ap.parse_args(argv)

    def say(msg: str) -> None:
        print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    import torch

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        say("no CUDA device visible to torch: run on a GPU machine, or give --device cpu --small for a dry run")
        return 2
    small = a.small
    result: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "ok": False}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def section(name: str, fn):
        """One part of the check: its failure is recorded under its name and the next part still runs (a GPU
        lease is short, so one run must say as much as it can); the JSON is written after every part, so that a
        run stopped at its time limit still leaves what it measured."""
        say(name)
        try:
            result[name] = fn()
        except Exception as e:  # noqa: BLE001 - whatever happened goes into the JSON, then the exit code
            import traceback

            result[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        say(json.dumps(result[name])[:2000])
        result["seconds"] = round(time.monotonic() - t0, 1)
        save(a.json, result)
        return result[name]

    section("environment", lambda: environment(a.device))
    section("staging", lambda: staging_bench(a.device, (8 << 20) if small else (256 << 20), 5 if small else 10))
    # fp8 goes first among the parts that start daemons: it is the shortest, so it also tells whether UCX moves
    # bytes between processes on this machine at all. Where it does not with UCX's own choice of transports (a
    # sandboxed kernel may refuse cross-memory attach or shared memory), the check says so and retries over tcp,
    # then runs the rest the way that worked.
    fp8 = section("fp8", lambda: fp8_check(a.device, 100 if small else 2000))
    if not fp8.get("bytes_equal") and not os.environ.get("UCX_TLS"):
        os.environ["UCX_TLS"] = "tcp,self"
        result["ucx_tls_fallback"] = {"reason": [c.get("error") for c in fp8.get("cases", [])] or fp8.get("error"),
                                      "UCX_TLS": "tcp,self"}
        fp8 = section("fp8", lambda: fp8_check(a.device, 100 if small else 2000))
    section("demo", lambda: demo_check(a.device, SMALL_SPEC if small else GPU_SPEC,
                                       a.prompt_tokens or (200 if small else 4096), 16 if small else 256,
                                       8 if small else 16, a.repeats or (3 if small else 7), say))
    section("cli_demo", lambda: cli_demo(a.device, a.json.with_name("demo-" + a.json.name)))
    d, st, cli = result["demo"], result["staging"], result["cli_demo"]
    errors = {k: v["error"] for k, v in result.items() if isinstance(v, dict) and "error" in v}
    if errors:
        result["error"] = "; ".join(f"{k}: {v}" for k, v in errors.items())
    result["ok"] = bool(not errors and d["tokens_match"] and all(r["slowdown_ok"] for r in d["modes"].values())
                        and st["bytes_equal"] and cli.get("tokens_match")
                        and fp8["bytes_equal"] and fp8["release_after_copies"])
    result["seconds"] = round(time.monotonic() - t0, 1)
    save(a.json, result)
    say(f"wrote {a.json} (ok={result['ok']}, {result['seconds']} s)")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    from pdpush import launch

    with launch.exit_on_signals():  # SIGTERM stops its daemons and removes its scratch directories
        sys.exit(main())
