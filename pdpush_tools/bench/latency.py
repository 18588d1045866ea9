"""``pdpush bench --scenario latency``: the fixed cost of a layer, and the sender's capacity in layers/s.

* ``one_chunk_p50_ms`` / ``p99``: a request of one chunk, every layer already in
  staging (as a GPU's DMA would leave it), from hand-over to every layer visible on
  the decode side (its readiness words read in a spin, so the clock stops when they
  land; what a decode engine's own wait adds is the decode_wait scenario's); every
  byte checked there. The hand-over does not block, so the
  same thread then waits as the decode engine would (a second thread in this
  process would share the GIL with the first and add its switching to the clock).
* ``layer_overhead_us``: per layer, that time less a raw UCX put+flush of the same
  bytes measured in the same run (``ceiling.measure_put``): the cost pdpush adds.
* ``sender_layer_ops_per_s``: several engine *processes* push many one-chunk
  requests through one sender at once; layers per second the sender completed
  (from its own counters). Each engine checks every tenth of its requests byte
  for byte on the decode side.
* ``prestaged``: the same with engines whose layers are already in staging, as a
  GPU's DMA leaves them (the transport-only case of the goodput scenario): each
  request takes its blocks and hands its layers over in one call, and only the
  tenth it checks is copied. The Python engines of the run above take more CPU per
  layer than the box has for everything at the target, so this is what isolates
  the sender's own capacity on 2 cores.

Steady state, not a cold pool: the pool is small and recycled (read requests are
released; unread ones leave after ``committed_ttl_ms``), and a warm-up first
touches every page. On one host the sender writes through its own mapping of the
receiver's segment, and a first write to a page costs a page fault there (~2 ms
for a cold 32-layer request here); an RDMA NIC has no such cost.

``handover``: "ring" (the default: records in the connection's ring in staging, docs/layout.md,
"The hand-over ring") or "messages" (a ``LayerReady`` per hand-over, the sender started with
``handover_ring_slots = 0``). ``compare`` runs both in one run and reports the ring's ratios.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

from pdpush import launch
from pdpush.client import DecodeClient, PrefillClient, status
from pdpush.layout import KVLayout
from pdpush_tools.bench import ceiling
from pdpush_tools.bench.common import SPIN, Source, StampedSource, child, push_handed_over, verify

FOOTPRINT_SAMPLES = 60
FOOTPRINT_PLACES = 64  # staging's and the pool's request places the footprint reference goes through


def _cpu_s(pid: int) -> float:
    """A process's CPU seconds so far (user + system, /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _engine(layout: dict, sock: str, rx_sock: str, tag: str, n: int, seed: int, prestaged: bool, q, go) -> None:
    """One engine process: ``n`` one-chunk requests, a layer handed over at a time, several requests in
    flight; every tenth is read back and checked on the decode side. It starts the requests when ``go`` is
    set, once every engine is up (a process's start and imports are not the sender's capacity), and reports
    the CPU of its requests alone. ``prestaged``: a request's layers are in staging already (not copied, but
    for the tenth it checks) and go over in one hand-over, or one per run of layers whose blocks were granted
    without waiting (a request larger than staging hands over what it holds before it waits for more)."""
    lay = KVLayout(**layout)
    try:
        pc = PrefillClient(lay, sock, timeout_s=60)
        dc = DecodeClient(rx_sock, timeout_s=60)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the run
        q.put({"error": f"{type(e).__name__}: {e}", "verified": False})
        return
    rng = np.random.default_rng(seed)
    src = Source(lay, rng.integers(0, 1 << 31, size=lay.chunk_tokens).tolist(), rng)
    in_flight: list = []
    verified = True
    try:  # start-up, not measured: a request through every path, and the daemons' segments mapped in here
        h = pc.begin(f"{tag}-warm", [seed * 1_000_000 + 900_000 + t for t in range(lay.chunk_tokens)])
        with dc.open(h.req_id) as req:
            for layer in range(lay.layers):
                h.put_layer(layer, *src.layer(layer))
            h.finish()
            req.wait_committed()
            verified = verify(req, src, lay)
        pc.wait_mapped(60)
        dc.wait_mapped(60)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the run
        q.put({"error": f"{type(e).__name__}: {e}", "verified": False})
        pc.close()
        dc.close()
        return
    q.put({"ready": tag})
    if not go.wait(120):
        q.put({"error": "never told to start", "verified": False})
        return
    cpu0 = time.process_time()
    try:
        def settle(h, req, s) -> None:
            nonlocal verified
            h.poll_done(60)
            if req is not None:
                with req:
                    req.wait_committed()
                    verified = verify(req, s, lay) and verified

        for i in range(n):
            ids = [seed * 1_000_000 + i * lay.chunk_tokens + t for t in range(lay.chunk_tokens)]
            h = pc.begin(f"{tag}-{i}", ids)
            # a request to check is opened now: an open reader keeps it from leaving after committed_ttl_ms,
            # which on a loaded box can pass between its commit and this engine getting round to it
            req = dc.open(h.req_id) if i % 10 == 0 else None
            # a request checked carries bytes of its own (the others, the same each time: a page left from an
            # earlier request of this engine would pass for one checked against them)
            s = StampedSource(lay, ids, seed * 100_000 + i) if req is not None else src
            if prestaged and req is None:
                staged: list[int] = []
                for layer in range(lay.layers):
                    if staged and not h.granted(layer):  # staging is full: what it holds goes before it waits
                        h.layers_ready(staged)
                        staged = []
                    h.staging_layer(layer)  # its block, as a device copy would take it, with nothing copied
                    staged.append(layer)
                h.layers_ready(staged)
            else:
                for layer in range(lay.layers):
                    h.put_layer(layer, *s.layer(layer))
            h.finish_nowait()
            in_flight.append((h, req, s))
            if len(in_flight) >= 4:
                settle(*in_flight.pop(0))
        for h, req, s in in_flight:
            settle(h, req, s)
        q.put({"error": None, "verified": verified, "cpu_s": time.process_time() - cpu0})
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the run
        q.put({"error": f"{type(e).__name__}: {e}", "verified": False})
    finally:
        pc.close()
        dc.close()


def box_ceiling(layer_bytes: int, copy_gbps: float, put_ops_out_of_cache: float, cores: int | None = None) -> dict:
    """The most layers/s this host could move with no pdpush code at all: each layer copied into staging once by an
    engine (at the staging copy's measured rate) and put once by the one sender process (at the native put loop's
    rate over as much memory as the pool: ``rate_oc``), those two alone on the host's cores, in parallel at will and
    nothing else running. The sender's puts are one process's: at most ``put_ops_out_of_cache``; and both copies
    together need ``copy + put`` seconds of a core per layer. An upper bound: it leaves out that the two copies
    share the memory bus."""
    cores = cores or len(os.sched_getaffinity(0))
    copy_s, put_s = layer_bytes / (copy_gbps * 1e9), 1 / put_ops_out_of_cache
    return {"ops_per_s": min(put_ops_out_of_cache, cores / (copy_s + put_s)), "cores": cores,
            "copy_us": copy_s * 1e6, "put_us": put_s * 1e6}


def wire_per_request(before: dict, after: dict, requests: int) -> dict:
    """The sender's wire-message counters (daemon.WireCount) between two status replies, per request."""
    b, a = json.loads(before.get("wire_messages", "{}")), json.loads(after.get("wire_messages", "{}"))
    by = {k: (a[k] - b.get(k, 0)) / requests for k in sorted(a) if a[k] != b.get(k, 0)}
    # the connection's hello and its ack serve every request it carries: their share shrinks as it lives on
    steady = sum(v for k, v in by.items() if k.split(":", 1)[1] not in ("hello", "hello_ack"))
    return {"total": sum(by.values()), "steady": steady, "by_kind": by}


def compare(layout: KVLayout, **kw) -> dict:
    """The scenario with the ring, then with messages, in one run: the ring's result, with the other's."""
    from pdpush_tools.bench import codec

    ring, msgs = run(layout, handover="ring", **kw), run(layout, handover="messages", prestaged=False, **kw)
    ring["codec_us"] = codec.measure(layout)  # the begin's four messages: fast path against msgpack + pydantic
    ring["messages"] = {k: msgs[k] for k in ("one_chunk_p50_ms", "one_chunk_p99_ms", "layer_overhead_us",
                                             "sender_layer_ops_per_s", "raw_put_us_per_layer", "verified")}
    ring["ratio_ring_ops"] = ring["sender_layer_ops_per_s"] / msgs["sender_layer_ops_per_s"]
    ring["ratio_ring_one_chunk"] = ring["one_chunk_p50_ms"] / msgs["one_chunk_p50_ms"]
    ring["verified"] = ring["verified"] and msgs["verified"]
    return ring


def _capacity(layout: KVLayout, tx, rx, tx_sock: str, rx_sock: str, engines: int, per_engine: int,
              prestaged: bool) -> dict:
    """``engines`` engine processes at once through the sender: layers/s from its own counters, each process's CPU."""
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=child, args=(_engine, layout.to_dict(), tx_sock, rx_sock,
                                             f"cap{'p' if prestaged else ''}{e}", per_engine, 100 + e, prestaged, q, go))
             for e in range(engines)]
    for p in procs:
        p.start()
    up = [q.get(timeout=120) for _ in procs]  # every engine started and connected, nothing sent yet
    if any("ready" not in u for u in up):
        for p in procs:  # the others wait on ``go``: stopped now, not left for its timeout
            p.kill()
            p.join(10)
        raise RuntimeError(f"a capacity engine failed to start: {up}")
    before = status(tx_sock)
    cpu0 = {"sender": _cpu_s(tx.pid), "receiver": _cpu_s(rx.pid)}
    t0 = time.perf_counter()
    go.set()
    outs = [q.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    cpu = {"sender": _cpu_s(tx.pid) - cpu0["sender"], "receiver": _cpu_s(rx.pid) - cpu0["receiver"],
           "engines": sum(o.get("cpu_s", 0.0) for o in outs)}
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    after = status(tx_sock)
    layers_done = after["layers_pushed"] - before["layers_pushed"]
    return {"before": before, "after": after, "layers_done": layers_done, "ops_per_s": layers_done / wall,
            "cpu_ms_per_1k_layers": {k: v * 1e6 / max(layers_done, 1) for k, v in cpu.items()},
            "cores_busy": {k: v / wall for k, v in cpu.items()},
            "errors": [o["error"] for o in outs if o["error"]], "verified": all(o["verified"] for o in outs)}


def run(layout: KVLayout, samples: int = 200, engines: int = 4, per_engine: int = 300,
        pool_pages: int = 256, handover: str = "ring", prestaged: bool = True, staging_bytes: int = 1 << 30) -> dict:
    wd = launch.scratch_dir("pdpush-bench-")
    daemons: list[launch.Daemon] = []
    try:
        # The capacity engines read back one request in ten: the others' pages come back committed_ttl_ms after
        # their commit, so the pool holds (rate x ttl) requests. At 300 ms, 48 pages of 32 MiB requests (1 MiB
        # layers) capped the run near 5,000 layers/s whatever the sender did; 50 ms leaves the pool out of it.
        # Staging is the sender's default (1 GiB): with 64 MiB, two 32 MiB requests filled it, and every layer
        # beyond waited on a NeedStaging/StagingGranted round trip (measured: 4,100-4,600 against 5,400-5,500
        # layers/s, and the sender's CPU per layer 150 against 117 us).
        rx = launch.start_receiver(wd, pool_pages=pool_pages, max_leases_per_sender=4096, committed_ttl_ms=50,
                                   **layout.to_dict())
        daemons.append(rx)
        tx = launch.start_sender(wd, default_receiver=rx.info["control_endpoint"], staging_bytes=staging_bytes,
                                 handover_ring_slots=256 if handover == "ring" else 0)
        daemons.append(tx)
        rx_sock = rx.info["local_endpoint"].removeprefix("ipc://")
        tx_sock = tx.info["ingress_endpoint"].removeprefix("ipc://")
        # the decode side spins on the readiness words: this measures when they land, not how a decode
        # engine chooses to wait for them (that is the decode_wait scenario's, against this same spin)
        pc = PrefillClient(layout, tx_sock, timeout_s=60)
        dc = DecodeClient(rx_sock, timeout_s=60, wait=SPIN)
        rng = np.random.default_rng(5)
        one, verified = [], True
        warm = pool_pages + 20  # every page touched once before anything is measured
        wire0, rx_wire0 = status(tx_sock), status(rx_sock)
        for i in range(samples + warm):
            src = Source(layout, rng.integers(0, 1 << 31, size=layout.chunk_tokens).tolist(), rng)
            r = push_handed_over(pc, dc, f"lat-{i}", src, layout)
            verified = r["verified"] and verified
            if i >= warm:
                one.append(r["seconds"])
        # Beside the target's reference (below: one request's puts again and again, its 2 MiB in this core's
        # caches), the same puts through a push's footprint: each source written with streaming stores as
        # stage_layer leaves staging, in a ring of staging's requests, into the next of the pool's request places,
        # posted at once with one flush. How much of the ratio is where the bytes are, not what pdpush does.
        # (A pool page holds a chunk of every layer: a request's place. 64 of each, 128 MiB at 64 KiB layers: out
        # of this host's caches, as staging's 1 GiB and the pool's 512 MiB are.)
        req_bytes = layout.layers * layout.page_bytes
        copies = min(FOOTPRINT_PLACES, max(1, staging_bytes // req_bytes)), min(FOOTPRINT_PLACES, pool_pages)
        footprint: list[float] = []
        with ceiling.put_reference(layout.page_bytes, layout.layers, *copies, batched=True) as ref:
            for _ in range(copies[1]):
                ref.once()  # each request place's first pass touches its remote pages
            try:
                footprint = [req_bytes / (ref.once(streamed=True) * 1e9) for _ in range(FOOTPRINT_SAMPLES)]
            except RuntimeError:  # no streaming stores on this CPU (_stream_fill): not measured, not reported
                footprint = []
        # capacity: engine processes at once, the sender's own counters
        rx_before, tx_before = status(rx_sock), status(tx_sock)  # (before the capacity engines' warm-up requests)
        cap = _capacity(layout, tx, rx, tx_sock, rx_sock, engines, per_engine, False)
        before, after = cap["before"], cap["after"]
        wire = wire_per_request(wire0, tx_before, samples + warm)
        rx_wire = wire_per_request(rx_wire0, rx_before, samples + warm)  # the receiver's side of the same
        loaded = wire_per_request(before, after, engines * per_engine)
        errors = cap["errors"]
        verified = verified and cap["verified"]
        pre = _capacity(layout, tx, rx, tx_sock, rx_sock, engines, per_engine, True) if prestaged else None
        if pre is not None:
            errors += pre["errors"]
            verified = verified and pre["verified"]
        pc.close()
        dc.close()
        # the reference: the same puts posted at once with one flush, as the sender posts a request's layers handed
        # over together (``put_seq``: each put+flush waited for in turn, from Python: about twice as long a layer
        # at 64 KiB, and the target's reference until 2026-12-07)
        put = ceiling.measure_put(layout.page_bytes, layout.layers, batched=True)
        put_seq = ceiling.measure_put(layout.page_bytes, layout.layers)
        rate = ceiling.measure_put_rate(layout.page_bytes, slots=layout.layers)["ops_per_s"]
        # The same loop over as much memory as the capacity run's pool (up to 1 GiB): the reference above cycles
        # through one request's worth (32 MiB at 1 MiB layers), which stays in this host's caches, while the sender
        # copies from a 1 GiB staging into pool pages that do not. Measured here: 1 MiB puts over 32 MiB 13,900/s,
        # over 256 MiB to 1 GiB 6,800/s, where the sender's memmove took 83% of its CPU (perf).
        span = max(layout.layers, min(pool_pages * layout.layers * layout.page_bytes, 1 << 30) // layout.page_bytes)
        rate_oc = ceiling.measure_put_rate(layout.page_bytes, slots=span, count=max(2000, span), windows=(16,),
                                           reps=3)["ops_per_s"][16]
        stage = ceiling.measure_stage(layout, layout.chunk_tokens)  # the engines' copy of a layer into staging
    finally:
        for d in daemons:
            d.stop()
    raw_layer_s = layout.page_bytes / (put["median_gbps"] * 1e9)
    p50 = statistics.median(one)
    ops = cap["ops_per_s"]
    box = box_ceiling(layout.page_bytes, stage["median_gbps"], rate_oc)
    return {"scenario": "latency", "handover": handover, "layout": layout.to_dict(), "page_bytes": layout.page_bytes,
            "handovers_ring": after.get("handovers_ring", 0) - before.get("handovers_ring", 0),
            "one_chunk_p50_ms": p50 * 1000, "one_chunk_p99_ms": _pct(one, 0.99) * 1000,
            "one_chunk_target_met": p50 * 1000 <= 1.0 * layout.layers / 32,
            "raw_put_us_per_layer": raw_layer_s * 1e6,
            "raw_put_seq_us_per_layer": layout.page_bytes / (put_seq["median_gbps"] * 1e9) * 1e6,
            "ratio_one_chunk_seq": p50 / (layout.layers * layout.page_bytes / (put_seq["median_gbps"] * 1e9)),
            "layer_overhead_us": (p50 / layout.layers - raw_layer_s) * 1e6,
            "layer_overhead_target_met": (p50 / layout.layers - raw_layer_s) * 1e6 <= 30,
            "sender_layer_ops_per_s": ops, "engines": engines, "requests_per_engine": per_engine,
            # who bounds the capacity run on this host's cores: each side's CPU, per 1,000 layers and as cores busy
            "capacity_cpu_ms_per_1k_layers": cap["cpu_ms_per_1k_layers"],
            "capacity_cores_busy": cap["cores_busy"],
            # the same with engines whose layers are in staging already (``prestaged``): the sender's own capacity
            **({"prestaged_layer_ops_per_s": pre["ops_per_s"], "ratio_prestaged_ops": pre["ops_per_s"] / rate[16],
                "prestaged_cpu_ms_per_1k_layers": pre["cpu_ms_per_1k_layers"],
                "prestaged_cores_busy": pre["cores_busy"],
                "ratio_prestaged_ops_out_of_cache": pre["ops_per_s"] / rate_oc} if pre else {}),
            "sender_ops_target_met": ops >= 20_000,
            # issue #22's ratios, against references measured in this run: the 1-chunk request against the
            # same puts back to back (each put+flush waited for, through pdpush's transport), and the sender's
            # capacity against a native loop of put+flush pairs of the layer's size (ceiling.measure_put_rate),
            # 16 in flight (pipelined, as the sender is) and 1 (back to back)
            "ratio_one_chunk": p50 / (layout.layers * raw_layer_s),
            **({"footprint_put_ms": statistics.median(footprint) * 1000, "footprint_places": list(copies),
                "ratio_one_chunk_footprint": p50 / statistics.median(footprint)} if footprint else {}),
            "raw_put_ops_per_s": rate[16], "raw_put_seq_ops_per_s": rate[1],
            "ratio_sender_ops": ops / rate[16],
            # against the loop over the pool's span of memory (rate_oc above): the sender's puts as they are
            "raw_put_ops_per_s_out_of_cache": rate_oc, "out_of_cache_bytes": span * layout.page_bytes,
            "ratio_sender_ops_out_of_cache": ops / rate_oc,
            # what this host's cores allow with no pdpush code at all (box_ceiling), and the capacity against it
            "box_ceiling_ops_per_s": box["ops_per_s"], "box_ceiling": box, "ratio_box_ceiling": ops / box["ops_per_s"],
            **({"ratio_prestaged_box_ceiling": pre["ops_per_s"] / rate_oc} if pre else {}),
            # control messages between the sender and the receiver daemons per request, both directions (the
            # sender's count of what it sent and received: each wire message once), and by kind
            "wire_messages_per_request": wire["total"], "wire_messages_by_kind": wire["by_kind"],
            "wire_messages_by_kind_receiver": rx_wire["by_kind"],
            # the target is the common case's: a request on a connection already up (its hello's share: to 0)
            "wire_messages_per_request_steady": wire["steady"],
            "wire_messages_target_met": wire["steady"] <= 2,
            # the same under the capacity run's load (engines at once: a frame serves several requests, ``Outbox``)
            "wire_messages_per_request_loaded": loaded["total"], "wire_messages_by_kind_loaded": loaded["by_kind"],
            "errors": errors, "samples": len(one), "verified": verified and not errors}
