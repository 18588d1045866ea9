"""Tensor-parallel pushes: N prefill rank *processes* push each request's heads through one sender
into one receiver, M decode ranks read theirs; every byte is verified on the decode side.

``pdpush bench --scenario goodput --prefill-ranks N --decode-ranks M`` runs it, with the same
requests pushed by a single rank in the same run as the reference (the ratio). Tests drive the
same ``Ranks`` to kill a rank mid-push.

Goodput = request bytes / (time from handing the request to the ranks until every rank has its
``Done``, i.e. the receiver committed every rank's share). Ranks are separate processes, as a
TP engine's workers are, so the GIL does not blur the measure.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import wait

import numpy as np

from pdpush import launch
from pdpush.client import DecodeClient, PrefillClient
from pdpush.errors import PdpushError
from pdpush.layout import KVLayout
from pdpush_tools.bench import ceiling
from pdpush_tools.bench.common import Source, child, verify


def source(layout: KVLayout, spec: dict) -> Source:
    """A request's KV, rebuilt from its spec in any process (each rank pushes its heads of it)."""
    first = None
    if spec.get("prefix"):
        first = source(layout, spec["prefix"])
    return Source(layout, spec["ids"], np.random.default_rng(spec["seed"]), first, spec.get("shared", 0))


def stage_layers(layers: int, pp: int, stage: int) -> tuple[int, int]:
    """Stage ``stage`` of ``pp``'s layers [first, end): an even split, the remainder on the first stages."""
    per, rem = divmod(layers, pp)
    first = stage * per + min(stage, rem)
    return first, first + per + (stage < rem)


def _rank(layout: dict, sock: str, receiver: str, rank: int, tp: int, inbox, outbox, pp: int = 1) -> None:
    """One prefill rank (participant ``rank``: stage ``rank // tp``, TP rank ``rank % tp``): pushes its share
    of its stage's layers of every request it is handed, reports its Done."""
    lay = KVLayout(**layout)
    stage, tp_rank = divmod(rank, tp)
    first, end = stage_layers(lay.layers, pp, stage)
    pc = PrefillClient(lay, sock, receiver=receiver, timeout_s=60)
    try:
        while True:
            job = inbox.get()
            if job is None:
                return
            rid, spec, stall = job["req_id"], job["spec"], job.get("stall_after_layer")
            try:
                src = source(lay, spec)
                if job.get("sync"):  # built: wait for the start signal, so the clock measures only the push
                    outbox.send({"rank": rank, "req_id": rid, "ready": True})
                    inbox.get()
                h = pc.begin(rid, spec["ids"], tp_rank=tp_rank, tp_size=tp, pp_rank=stage, pp_size=pp,
                             layers=(first, end) if pp > 1 else None)
                for layer in range(first, end):
                    h.put_layer(layer, *src.layer(layer))
                    if stall is not None and layer == stall:
                        outbox.send({"rank": rank, "req_id": rid, "stalled": True})
                        time.sleep(3600)  # the test kills this process here
                d = h.finish()
                outbox.send({"rank": rank, "req_id": rid, "error": None, "t": time.monotonic(),
                            "rank_puts": d.rank_puts, "puts": d.puts, "chunks_skipped": d.chunks_skipped,
                            "layers": d.layers})
            except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the run
                outbox.send({"rank": rank, "req_id": rid, "error": f"{type(e).__name__}: {e}",
                            "code": e.code.value if isinstance(e, PdpushError) else None, "t": time.monotonic()})
    finally:
        pc.close()


class Ranks:
    """``tp`` prefill rank processes on one sender (``tp * pp`` with ``pp`` pipeline stages: participant
    ``p`` is stage ``p // tp``'s TP rank ``p % tp``); stopped by pid in ``close`` (also on failure).

    Each rank reports on a pipe of its own: a rank the tests kill must not take a lock that the
    others need (a shared multiprocessing.Queue's write lock dies held with a killed writer)."""

    def __init__(self, layout: KVLayout, sender_sock: str, tp: int, receiver: str = "", pp: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self.tp = n = tp * pp
        pipes = [ctx.Pipe(duplex=False) for _ in range(n)]
        self.outs = [r for r, _ in pipes]
        self.inboxes = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=child, args=(_rank, layout.to_dict(), sender_sock, receiver, r, tp,
                                                      self.inboxes[r], pipes[r][1], pp), daemon=True)
                      for r in range(n)]
        for p in self.procs:
            p.start()

    def push(self, req_id: str, spec: dict, stall: dict[int, int] | None = None, sync: bool = False) -> None:
        """Hand a request to every rank. ``sync``: the ranks build their KV first; ``go()`` starts them."""
        for r, q in enumerate(self.inboxes):
            q.put({"req_id": req_id, "spec": spec, "stall_after_layer": (stall or {}).get(r), "sync": sync})
        if sync:
            self.results()

    def go(self) -> float:
        t0 = time.monotonic()
        for q in self.inboxes:
            q.put("go")
        return t0

    def results(self, n: int | None = None, timeout_s: float = 120) -> list[dict]:
        """The next ``n`` reports (default: one per rank), in arrival order."""
        deadline = time.monotonic() + timeout_s
        got: list[dict] = []
        while len(got) < (n or self.tp):
            ready = wait(self.outs, max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"{len(got)} of {n or self.tp} rank reports within {timeout_s} s")
            for conn in ready:
                try:
                    got.append(conn.recv())
                except EOFError:  # that rank died; the others still report
                    self.outs.remove(conn)
        return got

    def close(self) -> None:
        for q in self.inboxes:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def read_ranks(dc: DecodeClient, req_id: str, src: Source, layout: KVLayout, ranks: int) -> bool:
    """Each of ``ranks`` decode ranks opens the request and checks its own heads, byte for byte."""
    ok = True
    for r in range(ranks):
        with dc.open(req_id, tp_rank=r, tp_size=ranks) as req:
            req.wait_committed()
            ok = verify(req, src, layout) and ok
    return ok


def _series(layout: KVLayout, tx_sock: str, dc: DecodeClient, tp: int, decode_ranks: int, tokens: int,
            requests: int, tag: str, rng: np.random.Generator) -> dict:
    ranks = Ranks(layout, tx_sock, tp)
    times, verified, rank_puts, errors = [], True, [], []
    try:
        for i in range(requests + 1):  # the first warms the ranks' connections and mappings
            spec = {"ids": rng.integers(0, 1 << 31, size=tokens).tolist(), "seed": int(rng.integers(1 << 31))}
            rid = f"{tag}-tp{tp}-{i}"
            ranks.push(rid, spec, sync=True)
            t0 = ranks.go()
            outs = ranks.results()
            errors += [o["error"] for o in outs if o.get("error")]
            if errors:
                break
            if i:
                times.append(max(o["t"] for o in outs) - t0)
                rank_puts += [o["rank_puts"] for o in outs]
            verified = read_ranks(dc, rid, source(layout, spec), layout, decode_ranks) and verified
    finally:
        ranks.close()
    return {"seconds": times, "verified": verified and not errors, "errors": errors, "rank_puts": rank_puts}


def run(layout: KVLayout, tokens: int, requests: int, prefill_ranks: int, decode_ranks: int,
        pool_shards: int | None = None) -> dict:
    """The same requests pushed by 1 rank, then by ``prefill_ranks`` (pool shards = that TP, as the
    operations guide advises), read by ``decode_ranks``; goodput ratio in the same run."""
    chunks = layout.num_chunks(tokens)
    request_bytes = layout.layers * chunks * layout.page_bytes
    shards = pool_shards or prefill_ranks
    wd = launch.scratch_dir("pdpush-bench-")
    daemons: list[launch.Daemon] = []
    try:
        rx = launch.start_receiver(wd, pool_pages=chunks * 4, pool_shards=shards, **layout.to_dict())
        daemons.append(rx)
        tx = launch.start_sender(wd, default_receiver=rx.info["control_endpoint"],
                                 staging_bytes=max(1 << 20, 2 * request_bytes + (1 << 20)))
        daemons.append(tx)
        tx_sock = tx.info["ingress_endpoint"].removeprefix("ipc://")
        dc = DecodeClient(rx.info["local_endpoint"].removeprefix("ipc://"), timeout_s=60)
        rng = np.random.default_rng(77)
        tag = f"{time.time_ns():x}"
        try:
            one = _series(layout, tx_sock, dc, 1, decode_ranks, tokens, requests, tag, rng)
            many = _series(layout, tx_sock, dc, prefill_ranks, decode_ranks, tokens, requests, tag, rng)
        finally:
            dc.close()
        put = ceiling.measure_put(chunks * layout.page_bytes, layout.layers)
    finally:
        for d in daemons:
            d.stop()

    def gbps(s: dict) -> float:
        return request_bytes / statistics.median(s["seconds"]) / 1e9 if s["seconds"] else float("nan")

    return {"scenario": "goodput_tp", "layout": layout.to_dict(), "tokens": tokens, "requests": requests,
            "prefill_ranks": prefill_ranks, "decode_ranks": decode_ranks, "pool_shards": shards,
            "bytes_per_request": request_bytes, "layer_bytes": chunks * layout.page_bytes,
            "goodput_gbps_1_rank": gbps(one), f"goodput_gbps_{prefill_ranks}_ranks": gbps(many),
            "ratio_ranks_to_one": gbps(many) / gbps(one), "ceiling_gbps": put["median_gbps"],
            # every rank hands over its share of every layer: shares the one sender moved per second of a request
            "layer_shares_per_s": (prefill_ranks * layout.layers / statistics.median(many["seconds"])
                                   if many["seconds"] else float("nan")),
            "ratio_to_ceiling": gbps(many) / put["median_gbps"],
            "max_puts_per_layer_per_rank": max(many["rank_puts"]) / layout.layers if many["rank_puts"] else None,
            "errors": one["errors"] + many["errors"], "verified": one["verified"] and many["verified"]}
