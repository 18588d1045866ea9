"""``pdpush bench`` scenarios beyond goodput: pipeline, incremental, concurrency, control.

Every scenario starts the real daemons, moves synthetic KV through them, verifies
bytes on the decode side, and reports medians and ratios against references
measured in the same run. Absolute times on shared 2-core machines are noise.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import statistics
import time

import numpy as np
import zmq

from pdpush import launch, protocol
from pdpush.client import DecodeClient, PrefillClient, status
from pdpush.errors import PdpushError
from pdpush.layout import KVLayout, chunk_keys
from pdpush.staging import ahead_bytes
from pdpush_tools.bench.common import OBSERVER, Source, StampedSource, child, push_one, verify


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class _Pair:
    """One receiver + n senders, with clients; stopped on exit."""

    def __init__(self, layout: KVLayout, pool_pages: int, staging_bytes: int, senders: int = 1, **rx_opts) -> None:
        self.layout = layout
        self.daemons: list[launch.Daemon] = []
        wd = launch.scratch_dir("pdpush-bench-")
        try:
            self.rx = launch.start_receiver(wd, pool_pages=pool_pages, **layout.to_dict(), **rx_opts)
            self.daemons.append(self.rx)
            self.tx = []
            for _ in range(senders):
                t = launch.start_sender(wd, default_receiver=self.rx.info["control_endpoint"],
                                        staging_bytes=staging_bytes)
                self.daemons.append(t)
                self.tx.append(t)
        except BaseException:
            self.close()
            raise

    def clients(self, i: int = 0) -> tuple[PrefillClient, DecodeClient]:
        return (PrefillClient(self.layout, self.tx[i].info["ingress_endpoint"].removeprefix("ipc://"), timeout_s=60),
                DecodeClient(self.rx.info["local_endpoint"].removeprefix("ipc://"), timeout_s=60, wait=OBSERVER))

    def close(self) -> None:
        for d in self.daemons:
            d.stop()

    def __enter__(self) -> _Pair:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 1 << 31, size=n).tolist()


def pipeline(layout: KVLayout, tokens: int, ratios=(0.25, 0.5, 1.0, 2.0, 4.0), reps: int = 3) -> dict:
    """Exposed transfer after the last layer, eager vs pipelined, over c/t (c = emulated compute per layer)."""
    chunks = layout.num_chunks(tokens)
    rng = np.random.default_rng(7)
    # every block granted at the allocation: no layer waits for a NeedStaging round trip (2x the request plus
    # 1 MiB was short by the metadata's share, and its last layer asked, ~1 ms more exposed)
    with _Pair(layout, pool_pages=chunks * 3, staging_bytes=ahead_bytes(chunks * layout.page_bytes,
                                                                         layout.layers)) as pair:
        pc, dc = pair.clients()
        n = 0

        def one(compute_s: float, pipelined: bool) -> dict:
            nonlocal n
            n += 1
            return push_one(pc, dc, f"pipe-{n}", Source(layout, _ids(rng, tokens), rng), layout,
                            compute_s=compute_s, pipelined=pipelined)

        for _ in range(3):  # warm-up: every pool page touched once
            one(0.0, False)
        # t: per-layer transfer, measured here as eager's exposed time / layers (copy into staging + put + notify)
        eager0 = [one(0.0, False) for _ in range(reps)]
        t = statistics.median(r["exposed_s"] for r in eager0) / layout.layers
        curve = []
        for ratio in ratios:
            c = ratio * t
            e = [one(c, False) for _ in range(reps)]
            p = [one(c, True) for _ in range(reps)]
            curve.append({"c_over_t": ratio, "compute_ms": c * 1000,
                          "exposed_ms_eager": statistics.median(r["exposed_s"] for r in e) * 1000,
                          "exposed_ms_pipelined": statistics.median(r["exposed_s"] for r in p) * 1000,
                          "verified": all(r["verified"] for r in e + p)})
        pc.close()
        dc.close()
    at1 = [x for x in curve if x["c_over_t"] >= 1.0]
    worst = max(x["exposed_ms_pipelined"] for x in at1)
    worst_any = max(x["exposed_ms_pipelined"] for x in curve)  # issue #36: at every compute-to-transfer ratio
    return {"scenario": "pipeline", "layout": layout.to_dict(), "tokens": tokens,
            "layer_bytes": chunks * layout.page_bytes, "layer_transfer_ms": t * 1000,
            "exposed_ms_eager": statistics.median(x["exposed_ms_eager"] for x in at1),
            "exposed_ms_pipelined": statistics.median(x["exposed_ms_pipelined"] for x in at1),
            "exposed_ms_pipelined_worst_c_ge_t": worst, "exposed_ms_pipelined_worst": worst_any,
            "target_met": worst_any <= t * 1000 + 2.0, "curve": curve,
            "verified": all(x["verified"] for x in curve)}


def incremental(layout: KVLayout, tokens: int, hits=(0.0, 0.25, 0.5, 0.75, 0.9)) -> dict:
    """Bytes on the wire for a prefix-hit fraction h, against (1-h) x full."""
    chunks = layout.num_chunks(tokens)
    rng = np.random.default_rng(8)
    full = layout.layers * chunks * layout.page_bytes
    rows = []
    with _Pair(layout, pool_pages=chunks * 3, staging_bytes=ahead_bytes(chunks * layout.page_bytes,
                                                                         layout.layers)) as pair:
        pc, dc = pair.clients()
        for i, h in enumerate(hits):
            base = Source(layout, _ids(rng, tokens), rng)
            push_one(pc, dc, f"inc-base-{i}", base, layout)
            shared = int(tokens * h)
            second = Source(layout, base.token_ids[:shared] + _ids(rng, tokens - shared), rng, base, shared)
            r = push_one(pc, dc, f"inc-{i}", second, layout)
            ideal = (1 - h) * full
            rows.append({"h": h, "bytes_sent": r["bytes_sent"], "ideal_bytes": ideal,
                         "ratio_to_ideal": r["bytes_sent"] / ideal if ideal else 1.0,
                         "within_one_chunk": abs(r["bytes_sent"] - ideal) <= layout.layers * layout.page_bytes,
                         "chunks_skipped": r["chunks_skipped"], "verified": r["verified"]})
        pc.close()
        dc.close()
    return {"scenario": "incremental", "layout": layout.to_dict(), "tokens": tokens, "full_bytes": full,
            "rows": rows, "target_met": all(r["within_one_chunk"] for r in rows),
            "verified": all(r["verified"] for r in rows)}


WARM = (1 << 20) - 1  # an engine's warm-up request, before the clock (``_concurrent_engine``)


def _conc_source(layout: KVLayout, run: int, i: int, j: int, tokens: int) -> StampedSource:
    """Request ``j`` of engine ``i`` in run ``run`` of the concurrency scenario: its engine makes it a layer at a time,
    and the decode side makes the same bytes again to check what landed (``StampedSource``: cheap to make, so that
    what the run measures is pdpush, not the making of random bytes). Each its own prompt: none shares a chunk with
    another (a shared one would be skipped)."""
    seed = run << 40 | (i + 1) << 20 | j
    return StampedSource(layout, _ids(np.random.default_rng(seed), tokens), seed)


def _mem_available() -> int:
    """This box's MemAvailable (bytes), what the scenario sizes itself to."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def size_concurrency(layout: KVLayout, tokens: int, senders: int, in_flight: int, mem_available: int) -> dict:
    """The pool and staging of the concurrency scenario on a box with ``mem_available`` bytes free (pure). Half of it
    is the scenario's: the senders' staging (four layers of each request in flight, as docs/layout.md sizes it, at
    most a quarter of the budget over all senders) and the pool, the rest. A pool short of every request in flight
    at once is the point, not a failure: the receiver answers ``pool_exhausted`` with ``retry_after``, the senders
    back off, and the scenario reports how often. The engines make their KV a layer at a time (``StampedSource``)."""
    chunks = layout.num_chunks(tokens)
    page_set = layout.layers * layout.page_bytes  # one chunk: its page in every layer
    budget = mem_available // 2
    staging = min(max(64 << 20, 4 * in_flight * chunks * layout.page_bytes), max(64 << 20, budget // (4 * senders)))
    need = chunks * (senders * in_flight + 2)
    room = max(0, budget - senders * staging) // page_set
    pages = max(chunks * (senders + 2), min(need, room))  # at least one request of each engine, and a spare
    return {"pool_pages": pages, "pool_pages_needed": need, "staging_bytes": staging, "memory_budget_bytes": budget,
            "pool_bytes": pages * page_set}


def _concurrent_engine(layout_d: dict, sock: str, run: int, i: int, tokens: int, n: int, window: int, q, done_q,
                       start) -> None:
    """One engine process of the concurrency scenario. Before it says it is ready, it pushes one request the clock
    does not count (``WARM``: its connection, lifeline, ring and mapped staging, and its sources' random layers, are
    not what the run measures). Then each of its ``n`` requests is begun (waiting, as a real engine would, while the
    sender backs off a full pool), handed over layer by layer and finished without waiting; at most ``window`` are in
    flight, the oldest collected when it is full. Reports each commit on ``done_q`` (the decode side reads and releases
    it), then its latencies (s), the bytes its requests moved and its end time on ``q``, whatever happens. Begins
    only when every engine is ready."""
    lat: list[float] = []
    errors: list[str] = []
    moved = 0
    pc = None
    try:
        layout = KVLayout(**layout_d)
        pc = PrefillClient(layout, sock, timeout_s=120)
        src = _conc_source(layout, run, i, WARM, tokens)
        h = pc.begin(f"conc-{run}-{i}-{WARM}", src.token_ids)
        for layer in range(layout.layers):
            h.put_layer(layer, *src.layer(layer))
        h.finish(120)
        pc.wait_mapped(60)
        done_q.put((run, i, WARM))  # checked and released before the clock starts
        q.put({"ready": i})
        if not start.wait(600):
            raise TimeoutError("never told to start")
        open_: list = []

        def collect(wait_s: float) -> None:
            """Report every request that has committed (the oldest waited for up to ``wait_s``): the decode side
            reads and releases it, which is what gives the pool back."""
            nonlocal moved
            for k, (j, h, t0) in enumerate(list(open_)):
                try:
                    done = h.poll_done(wait_s if k == 0 else 0.0)
                    if done is None:
                        if k == 0 and wait_s:
                            errors.append(f"sender {i} request {j}: no commit within {wait_s:.0f} s")
                            open_.remove((j, h, t0))
                        continue
                    lat.append(time.perf_counter() - t0)
                    moved += done.bytes_sent
                    done_q.put((run, i, j))
                except PdpushError as e:
                    errors.append(f"sender {i} request {j}: {e.code.value}: {e}")
                open_.remove((j, h, t0))

        for j in range(n):
            collect(0.0)  # before this begin waits on a full pool: what has committed goes to be read
            src = _conc_source(layout, run, i, j, tokens)
            t0 = time.perf_counter()
            try:
                h = pc.begin(f"conc-{run}-{i}-{j}", src.token_ids)
                for layer in range(layout.layers):
                    h.put_layer(layer, *src.layer(layer))
                h.finish_nowait()
            except PdpushError as e:
                errors.append(f"sender {i} request {j}: {e.code.value}: {e}")
                continue
            open_.append((j, h, t0))
            while len(open_) >= window:
                collect(120.0)
        while open_:
            collect(120.0)
    except Exception as e:  # noqa: BLE001 - reported to the bench, which fails the run
        errors.append(f"sender {i}: {type(e).__name__}: {e}")
    finally:
        if pc is not None:
            pc.close()
        q.put({"lat": lat, "bytes": moved, "t_end": time.perf_counter(), "errors": errors})


def _engines(layout: KVLayout, pair: _Pair, dc: DecodeClient, run: int, engines: int, tokens: int, n: int,
             window: int) -> dict:
    """Run ``run``: ``engines`` engine *processes*, one per sender (threads of one process would share a GIL and blur
    what is measured), ``n`` requests each with ``window`` in flight; the decode side here reads and checks every byte
    of each request as it commits, and releases it, as a decode engine would. The clock runs from the engines' start
    to the last one's end."""
    ctx = mp.get_context("spawn")
    q, done_q, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    socks = [t.info["ingress_endpoint"].removeprefix("ipc://") for t in pair.tx[:engines]]
    procs = [ctx.Process(target=child, args=(_concurrent_engine, layout.to_dict(), socks[i], run, i, tokens, n,
                                             window, q, done_q, start)) for i in range(engines)]
    for p in procs:
        p.start()
    outs: list[dict] = []
    verified, read, check_cpu = True, 0, 0.0

    def check(item, clocked: bool = True) -> None:
        nonlocal verified, read, check_cpu
        r, i, j = item
        c0 = time.thread_time()
        with dc.open(f"conc-{r}-{i}-{j}", timeout_s=60) as req:
            verified = verify(req, _conc_source(layout, r, i, j, tokens), layout) and verified
        if clocked:
            check_cpu += time.thread_time() - c0
        read += j != WARM

    def check_the_rest(wait_s: float) -> None:
        """Check what the engines reported until none comes for ``wait_s`` (outside the clock)."""
        while True:
            try:
                item = done_q.get(timeout=wait_s)
            except Exception:  # noqa: BLE001 - queue.Empty: all read
                return
            check(item, clocked=False)

    try:
        ready, deadline = 0, time.monotonic() + 600
        while ready < len(procs):  # every engine warmed up and connected: start the clock, then let them go
            try:
                msg = q.get(timeout=1.0)
            except Exception:  # noqa: BLE001 - queue.Empty: an engine that died meanwhile ends the run
                if time.monotonic() > deadline or any(p.exitcode is not None for p in procs):
                    raise RuntimeError("a concurrency engine died or did not start") from None
                continue
            if "ready" not in msg:
                raise RuntimeError(f"a concurrency engine failed to start: {msg['errors']}")
            ready += 1
        check_the_rest(0.2)  # their warm-up requests, read and released before the clock
        t0 = time.perf_counter()
        start.set()
        deadline = time.monotonic() + 600
        while len(outs) < len(procs) and time.monotonic() < deadline:
            try:
                item = done_q.get(timeout=0.05)
            except Exception:  # noqa: BLE001 - queue.Empty: nothing committed meanwhile
                with contextlib.suppress(Exception):
                    outs.append(q.get_nowait())
                continue
            check(item)
        check_the_rest(0.5)  # commits reported after the last engine's summary
        if len(outs) < len(procs):
            outs += [{"lat": [], "errors": ["an engine process did not report within 600 s"]}] * (len(procs) - len(outs))
        wall = max((o["t_end"] for o in outs if "t_end" in o), default=time.perf_counter()) - t0
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    lat = [x for o in outs for x in o["lat"]]
    errors = [e for o in outs for e in o["errors"]]
    return {"lat": lat, "errors": errors, "wall": wall, "read": read, "check_cpu": check_cpu,
            "gbps": sum(o.get("bytes", 0) for o in outs) / wall / 1e9 if wall > 0 else 0.0,
            # every committed request was read back whole; a request refused for a full pool (past the senders'
            # alloc_retry_budget_ms) is what overload looks like, reported, not a wrong byte
            "verified": verified and read == len(lat) and len(errors) == sum("pool_exhausted" in e for e in errors)}


def concurrency(layout: KVLayout, tokens: int, senders: int = 4, in_flight: int = 16, requests: int | None = None,
                mem_available: int | None = None) -> dict:
    """``senders`` sender daemons, each fed by one engine process with ``in_flight`` requests in flight (``requests``
    each, 2 x in_flight by default), into one receiver whose pool is sized to this box (``size_concurrency``); a decode
    side reads and releases each request as it commits (checking every byte), as a decode engine would. Against a
    single stream: the same with one engine process through one sender, one request at a time (``_engines`` for
    both, so that the engines' making of their bytes, and the decode side's check, weigh the same on each)."""
    n = requests or 2 * in_flight
    chunks = layout.num_chunks(tokens)
    req_bytes = layout.layers * chunks * layout.page_bytes
    size = size_concurrency(layout, tokens, senders, in_flight, mem_available or _mem_available())
    with _Pair(layout, pool_pages=size["pool_pages"], staging_bytes=size["staging_bytes"], senders=senders) as pair:
        pc, dc = pair.clients(0)
        pc.close()  # (the decode side's client only: the engines are processes of their own)
        try:
            # every sender's data plane to the receiver up and its view of the pool mapped, before anything is timed
            warm = _engines(layout, pair, dc, 0, senders, tokens, min(in_flight, 4), 1)
            single = _engines(layout, pair, dc, 1, 1, tokens, min(n, 8), 1)
            before = [status(t.info["ingress_endpoint"].removeprefix("ipc://")) for t in pair.tx]
            agg = _engines(layout, pair, dc, 2, senders, tokens, n, in_flight)
            after = [status(t.info["ingress_endpoint"].removeprefix("ipc://")) for t in pair.tx]
        finally:
            dc.close()
    lat, errors = agg["lat"], agg["errors"] + warm["errors"]
    retries = sum(a["alloc_retries"] - b["alloc_retries"] for a, b in zip(after, before, strict=True))
    return {"scenario": "concurrency", "layout": layout.to_dict(), "tokens": tokens, "senders": senders,
            "in_flight_per_sender": in_flight, "requests_per_sender": n, "request_bytes": req_bytes, **size,
            "pool_short": size["pool_pages"] < size["pool_pages_needed"],
            "alloc_retries": retries, "pool_exhausted_failures": sum("pool_exhausted" in e for e in errors),
            "single_stream_gbps": single["gbps"], "single_stream_requests": len(single["lat"]),
            "aggregate_gbps": agg["gbps"], "ratio": agg["gbps"] / single["gbps"] if single["gbps"] else 0.0,
            "latency_p50_ms": _pct(lat, 0.5) * 1000 if lat else None,
            "latency_p99_ms": _pct(lat, 0.99) * 1000 if lat else None,
            "latency_max_ms": max(lat) * 1000 if lat else None,
            "completed": len(lat), "read_on_decode": agg["read"], "errors": (errors + single["errors"])[:20],
            # the decode side's reading and checking of every byte, on the same cores during each run's clock
            "decode_check_cores": agg["check_cpu"] / agg["wall"] if agg["wall"] > 0 else 0.0,
            "single_decode_check_cores": single["check_cpu"] / single["wall"] if single["wall"] > 0 else 0.0,
            "target_met": agg["gbps"] >= 0.95 * single["gbps"] and not errors and not single["errors"],
            "verified": agg["verified"] and single["verified"] and warm["verified"] and not single["errors"]
            and not warm["errors"]}


def control(layout: KVLayout | None = None, n: int = 1000, requests: int = 200) -> dict:
    """AllocRequest -> AllocResponse round trip (raw), and the end-to-end overhead of a 1-chunk request
    (every byte of every request checked on the decode side)."""
    layout = layout or KVLayout(32, 8, 128, "bfloat16", 16)
    # aborted leases would sit in quarantine: without it, 64 pages serve any number of round trips
    with _Pair(layout, pool_pages=64, staging_bytes=64 << 20, quarantine_ms=0) as pair:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(pair.rx.info["control_endpoint"])

        def ask(m: protocol.Msg) -> protocol.Msg:
            s.send(protocol.encode(m))
            if not s.poll(5000):
                raise PdpushError("receiver did not answer")
            return protocol.decode(s.recv())

        ask(protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=layout.fingerprint(),
                           layout=protocol.LayoutSpec(**layout.to_dict())))
        rtt = []
        for i in range(n):
            keys = chunk_keys([i, i + 1], layout)
            t = time.perf_counter()
            reply = ask(protocol.AllocRequest(req_id=f"c{i}", chunk_keys=keys, last_chunk_tokens=2, lease_ms=1000))
            rtt.append(time.perf_counter() - t)
            assert isinstance(reply, protocol.AllocResponse), reply
            ask(protocol.Abort(req_id=f"c{i}", settled=True))  # nothing was put to its pages: free at once
        s.close(0)
        # end to end: begin, every layer of one chunk, commit ack; then the decode side checks the bytes
        pc, dc = pair.clients()
        rng = np.random.default_rng(10)
        e2e = []
        verified = True
        for i in range(requests):
            src = Source(layout, _ids(rng, layout.chunk_tokens), rng)
            t = time.perf_counter()
            h = pc.begin(f"tiny-{i}", src.token_ids)
            for layer in range(layout.layers):
                h.put_layer(layer, *src.layer(layer))
            h.finish()
            e2e.append(time.perf_counter() - t)
            with dc.open(f"tiny-{i}") as req:  # released after: its pages may be reused
                verified = verify(req, src, layout) and verified
        pc.close()
        dc.close()
    return {"scenario": "control", "alloc_rtt_p50_ms": _pct(rtt, 0.5) * 1000, "alloc_rtt_p99_ms": _pct(rtt, 0.99) * 1000,
            "one_chunk_request_p50_ms": _pct(e2e, 0.5) * 1000, "one_chunk_request_p99_ms": _pct(e2e, 0.99) * 1000,
            "one_chunk_layers": layout.layers, "layout": layout.to_dict(), "samples": {"alloc": n, "e2e": len(e2e)},
            "verified": verified}
