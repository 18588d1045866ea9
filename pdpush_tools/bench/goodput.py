"""``pdpush bench --scenario goodput``: PrefillClient -> sender -> receiver -> DecodeClient, every byte verified.

Goodput = new bytes of a request / (time from ``begin`` until the decode side
sees every layer). The ceiling is a raw UCX put+flush of the same layer sizes
between two processes, and the memcpy of the same bytes, both in this run.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path

import numpy as np

from pdpush import launch
from pdpush.client import DecodeClient, PrefillClient
from pdpush.layout import KVLayout
from pdpush.staging import ahead_bytes
from pdpush_tools.bench import ceiling
from pdpush_tools.bench.common import OBSERVER, SPIN, Source, push_handed_over, push_one

TRANSPORT_SAMPLES = 9  # transport only is cheap: more pairs than the end to end's requests


def run(*, layers: int, kv_heads: int, head_dim: int, dtype: str, tokens: int, chunk_tokens: int, requests: int,
        prefix_shared: float, receiver_config: Path | None = None, sender_config: Path | None = None,
        compare_nixl: bool = False, kind: str = "mha") -> dict:
    layout = KVLayout(layers, kv_heads, head_dim, dtype, chunk_tokens, kind=kind)  # type: ignore[arg-type]
    chunks = layout.num_chunks(tokens)
    request_bytes = layers * chunks * layout.page_bytes
    daemons: list[launch.Daemon] = []
    wd = launch.scratch_dir("pdpush-bench-")
    try:
        if receiver_config is not None:
            from pdpush import config as cfgmod

            rcfg = cfgmod.read_receiver(receiver_config)
            scfg = cfgmod.load(cfgmod.SenderConfig, sender_config)
            layout = rcfg.layout
            chunks = layout.num_chunks(tokens)
            request_bytes = layout.layers * chunks * layout.page_bytes
            rx_local, tx_ingress = rcfg.local_socket_path(), scfg.ingress_socket_path()
            pool_pages = rcfg.pool_pages
            staging_bytes = scfg.staging_bytes
            receiver = f"tcp://{rcfg.host}:{rcfg.control_port}"
        else:
            pool_pages = chunks * 3
            staging_bytes = ahead_bytes(chunks * layout.page_bytes, layers)  # no layer waits for its block
            rx = launch.start_receiver(wd, pool_pages=pool_pages, **layout.to_dict())
            daemons.append(rx)
            tx = launch.start_sender(wd, default_receiver=rx.info["control_endpoint"], staging_bytes=staging_bytes)
            daemons.append(tx)
            rx_local = rx.info["local_endpoint"].removeprefix("ipc://")
            tx_ingress = tx.info["ingress_endpoint"].removeprefix("ipc://")
            receiver = rx.info["control_endpoint"]
        pc = PrefillClient(layout, tx_ingress, receiver=receiver, timeout_s=60)
        dc = DecodeClient(rx_local, timeout_s=60, wait=OBSERVER)  # the clock stops when the layers land
        rng = np.random.default_rng(1234)
        tag = f"{time.time_ns():x}"

        def fresh_ids(n: int) -> list[int]:
            return rng.integers(0, 1 << 31, size=n).tolist()

        metrics_ep = daemons[1].info.get("metrics_endpoint") if len(daemons) > 1 else None
        results = []
        # Warm-up: enough requests to touch every pool page once, so that the measured ones see the
        # steady state (each process faults a shared page in once per mapping; ~0.1 s per GiB here).
        warmup = max(1, -(-pool_pages // chunks)) if pool_pages else 1
        for i in range(requests + warmup):
            src = Source(layout, fresh_ids(tokens), rng)
            r = push_one(pc, dc, f"bench-{tag}-{i}", src, layout)
            if i == warmup - 1:
                put_before = _put_seconds(metrics_ep)
            if i >= warmup:
                results.append(r)
        put_after = _put_seconds(metrics_ep)
        # Transport only: the engine's output already sits in staging when the clock starts. Each request is
        # paired with a raw put+flush of its bytes just before it, through a push's footprint (the staging
        # ring's and the pool's requests, each source written just before, as staging is): below a few MiB a
        # request, the same memory put again stays in cache (``ceiling_gbps``), which no push's does.
        # Timed as the latency scenario times a request (``push_handed_over``: hand-over, then the same thread
        # spins on the readiness words), and, as before 2026-12-05, through ``push_one``'s decode thread, whose
        # naps and GIL switching cost 10-20% of a 256 KiB to 1 MiB request here (``transport_observed``). Each
        # is paired with the raw put+flush above and with the same puts posted at once with one flush, their
        # source streamed as staging's is (``strict``: a push's own pattern, without pdpush).
        layer_bytes = chunks * layout.page_bytes
        transport, observed, footprint, strict = [], [], [], []
        # (a configured sender's staging and receiver's pool may be far larger: at most 16 requests' places each)
        copies = min(16, max(1, staging_bytes // request_bytes)), min(16, max(1, pool_pages // chunks))
        spin = DecodeClient(rx_local, timeout_s=60, wait=SPIN)
        with contextlib.closing(spin), ceiling.put_reference(layer_bytes, layout.layers, *copies, rewrite=True) as ref:
            for _ in range(copies[1]):
                ref.once()  # each request's first pass touches its remote pages
            for i in range(max(requests, TRANSPORT_SAMPLES)):
                footprint.append(ref.once())
                strict.append(ref.once(batched=True, streamed=True))
                transport.append(push_handed_over(pc, spin, f"bench-{tag}-t{i}", Source(layout, fresh_ids(tokens), rng),
                                                  layout))
                observed.append(push_one(pc, dc, f"bench-{tag}-o{i}", Source(layout, fresh_ids(tokens), rng),
                                         layout, prestaged=True))
        # Incremental: a first request, then one sharing its first prefix_shared of tokens.
        shared = int(tokens * prefix_shared)
        first = Source(layout, fresh_ids(tokens), rng)
        r1 = push_one(pc, dc, f"bench-{tag}-p1", first, layout)
        second = Source(layout, first.token_ids[:shared] + fresh_ids(tokens - shared), rng, first, shared)
        r2 = push_one(pc, dc, f"bench-{tag}-p2", second, layout)
        pc.close()
        dc.close()
        put = ceiling.measure_put(layer_bytes, layout.layers)
        mem = ceiling.measure_memcpy(layer_bytes, layout.layers)
        # through a push's footprint (its staging ring, its pool's requests); the same four slots and the same
        # destination each pass (``two_copy_hot``) stay in cache below a few MiB a request, as no push does
        # (8 passes each: a pass of a small request is a millisecond or two, and single passes moved 3x here)
        two = ceiling.measure_two_copy(layer_bytes, layout.layers, reps=8, ring_bytes=min(staging_bytes, 1 << 30),
                                       dst_copies=copies[1])
        two_hot = ceiling.measure_two_copy(layer_bytes, layout.layers, reps=8)
        stage = ceiling.measure_stage(layout, tokens)
        paged = ceiling.measure_paged_stage(layout, tokens)
        nixl = None
        if compare_nixl:
            from pdpush_tools.bench import nixl_ref

            nixl = (nixl_ref.measure(layer_bytes, layout.layers) if nixl_ref.available()
                    else {"error": "nixl is not installed (pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1)"})
    finally:
        for d in daemons:
            d.stop()
    good = statistics.median(r["goodput_gbps"] for r in results)
    return {
        "scenario": "goodput",
        "layout": layout.to_dict(), "tokens": tokens, "requests": requests,
        "verified": all(r["verified"] for r in results + transport + observed) and r1["verified"] and r2["verified"],
        "bytes_total": sum(r["bytes_sent"] for r in results),
        "bytes_per_request": request_bytes,
        "layer_bytes": layer_bytes,
        "goodput_gbps": good,
        "goodput_samples_gbps": [r["goodput_gbps"] for r in results],
        "ceiling_gbps": put["median_gbps"],
        "ceiling_samples_gbps": put["samples_gbps"],
        "memcpy_gbps": mem["median_gbps"],
        # the one-host limit end to end: copier process -> staging -> put by another, pipelined (issue #22)
        "two_copy_gbps": two["median_gbps"],
        "two_copy_samples_gbps": two["samples_gbps"],
        "ratio_two_copy": good / two["median_gbps"],
        "two_copy_hot_gbps": two_hot["median_gbps"],
        "ratio_two_copy_hot": good / two_hot["median_gbps"],
        # the same requests from the begin's answer on: a begin made at scheduling time (the vLLM connector's, or
        # begin_nowait before the forward) is answered while the layers compute, so its round trip is not here
        "begin_ms_p50": statistics.median(r["begin_s"] for r in results) * 1000,
        "begun_goodput_gbps": statistics.median(r["begun_goodput_gbps"] for r in results),
        "ratio_two_copy_begun": statistics.median(r["begun_goodput_gbps"] for r in results) / two["median_gbps"],
        "ratio": good / put["median_gbps"],
        "ratio_memcpy": good / mem["median_gbps"],
        "transport_goodput_gbps": statistics.median(r["goodput_gbps"] for r in transport),
        "transport_samples_gbps": [r["goodput_gbps"] for r in transport],
        # against the raw put through the same footprint, paired request by request (the target's reference)
        "footprint_put_gbps": statistics.median(footprint),
        "footprint_put_samples_gbps": footprint,
        "footprint_copies": list(copies),
        "ratio_transport": _paired(transport, footprint),
        # against the same puts posted at once, with one flush, their source streamed (the stricter reference)
        "strict_put_gbps": statistics.median(strict),
        "ratio_transport_strict": _paired(transport, strict),
        # the same through push_one's decode thread (how transport only was timed until 2026-12-05)
        "transport_observed_gbps": statistics.median(r["goodput_gbps"] for r in observed),
        "ratio_transport_observed": _paired(observed, footprint),
        # against the same memory put again (in cache below a few MiB a request)
        "ratio_transport_hot": statistics.median(r["goodput_gbps"] for r in transport) / put["median_gbps"],
        "puts_per_layer": statistics.median(r["puts"] / layout.layers for r in results),
        "prefix_shared": prefix_shared,
        "bytes_sent_first": r1["bytes_sent"],
        "bytes_sent_second": r2["bytes_sent"],
        "chunks_skipped_second": r2["chunks_skipped"],
        "warmup_requests": warmup,
        "nixl": nixl,
        "nixl_gbps": nixl.get("median_gbps") if nixl else None,
        "ratio_nixl": good / nixl["median_gbps"] if nixl and "median_gbps" in nixl else None,
        "staging_copy_gbps": stage["median_gbps"],  # the engine's copy into staging, as put_layer makes it
        "staging_memcpy_gbps": stage["memcpy_gbps"],  # its reference, each repetition paired with one
        "ratio_staging_copy": stage["ratio"],
        # the same with cached stores (pdpush_native's set_streaming(False)): what streaming them saves
        "staging_copy_cached_gbps": stage["cached_gbps"],
        "ratio_staging_copy_cached": stage["cached_ratio"],
        # the vLLM connector's copy from paged blocks (CPU_ATTN tiles) into staging: one pass, and the two it replaced
        "paged_stage_gbps": paged.get("one_pass_gbps"),
        "paged_two_pass_gbps": paged.get("two_pass_gbps"),
        "paged_staging_order_gbps": paged.get("staging_order_gbps"),  # its table in staging's order, not the cache's
        "ratio_paged_stage": paged.get("one_pass_ratio"),
        "client_copy_ms_per_layer": statistics.median(r["client_copy_s"] for r in results) * 1000 / layout.layers,
        "sender_put_ms_per_layer": ((put_after[0] - put_before[0]) / (put_after[1] - put_before[1]) * 1000
                                    if put_before and put_after and put_after[1] > put_before[1] else float("nan")),
        "requests_detail": results + [r1, r2],
    }


def _paired(pushes: list[dict], refs: list[float]) -> float:
    """The median of each push's goodput over its paired reference's."""
    return statistics.median(r["goodput_gbps"] / f for r, f in zip(pushes, refs, strict=True))


def _put_seconds(endpoint: str | None) -> tuple[float, float] | None:
    """(sum, count) of the sender's pdpush_layer_transfer_seconds histogram."""
    if not endpoint:
        return None
    import urllib.request

    vals = {}
    for line in urllib.request.urlopen(endpoint, timeout=5).read().decode().splitlines():
        if line.startswith("pdpush_layer_transfer_seconds_sum") or line.startswith("pdpush_layer_transfer_seconds_count"):
            name, v = line.rsplit(" ", 1)
            vals[name] = float(v)
    return vals.get("pdpush_layer_transfer_seconds_sum", 0.0), vals.get("pdpush_layer_transfer_seconds_count", 0.0)


def print_table(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"pdpush goodput ({res['layout']['layers']} layers, {res['tokens']} tokens, "
                    f"{res['layout']['dtype']}, {res['layer_bytes'] / 2**20:.1f} MiB/layer)")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_row("verified (every byte, decode side)", str(res["verified"]))
    t.add_row("goodput, median GB/s", f"{res['goodput_gbps']:.2f}")
    t.add_row("raw UCX put+flush ceiling, median GB/s", f"{res['ceiling_gbps']:.2f}")
    t.add_row("memcpy, median GB/s", f"{res['memcpy_gbps']:.2f}")
    t.add_row("ratio to ceiling", f"{res['ratio']:.2f}")
    t.add_row("ratio to memcpy", f"{res['ratio_memcpy']:.2f}")
    t.add_row("staging copy (kvcodec.stage_planned, as put_layer, into a ring of staging), median GB/s",
              f"{res['staging_copy_gbps']:.2f} ({res['ratio_staging_copy']:.2f}x memcpy; cached stores "
              f"{res['staging_copy_cached_gbps']:.2f}, {res['ratio_staging_copy_cached']:.2f}x)")
    t.add_row("transport only (KV already in staging), GB/s / ratio (paired, a push's footprint; the same memory)",
              f"{res['transport_goodput_gbps']:.2f} / {res['ratio_transport']:.2f}; {res['ratio_transport_hot']:.2f}")
    if res.get("nixl"):
        n = res["nixl"]
        t.add_row("NIXL raw DRAM->DRAM WRITE, median GB/s",
                  f"{n['median_gbps']:.2f} (ratio {res['ratio_nixl']:.2f})" if "median_gbps" in n else n["error"])
    t.add_row("puts per layer", f"{res['puts_per_layer']:.1f}")
    t.add_row("per layer: engine copy into staging / sender put+flush, ms",
              f"{res['client_copy_ms_per_layer']:.2f} / {res['sender_put_ms_per_layer']:.2f}")
    t.add_row("bytes sent: first / second (prefix-shared)",
              f"{res['bytes_sent_first']:,} / {res['bytes_sent_second']:,}")
    t.add_row("chunks skipped by second", str(res["chunks_skipped_second"]))
    Console().print(t)
