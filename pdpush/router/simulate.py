"""``pdpush simulate``: a request trace replayed through the router's own placement code, for N
prefill and M decode instances, under each policy.

The placement is the router's, not a copy: ``round_robin`` and ``decode_cache_aware`` are
``placement.choose_decode`` (in turn, or by held prefix weighed against load), with
``placement.choose_prefill`` (least loaded) for the prefill leg; ``least_loaded`` takes the least
loaded instance on both legs; ``cost_model`` is ``costmodel.choose``. What the simulator adds is the
world they act on:

* **Caches.** Each prefill instance's own prefix cache and each decode receiver's pool are LRU sets of
  blocks; a request hits the longest leading run of its blocks held where it goes (the trace's
  ``hash_ids`` are chained prefix hashes, so equal leading ids mean an equal prefix). After the
  request both hold every block of its prompt.
* **Prefill instances** compute the blocks their cache does not hold, first come first served, at
  ``prefill_tokens_per_s``; the receiver's missing blocks stream during that compute and only what is
  left of the push after it is exposed (``bytes_per_s``; at least one layer's share).
* **Decode instances** have ``decode_slots`` requests decoding at once; a request starts once its KV
  is in and a slot is free, its first token one ``tpot_s`` later, and holds the slot for its output.
* With ``conditional`` (``local_tokens_per_s`` > 0), the cost model may let a decode instance compute
  a prompt whose prefix its receiver holds, at that speed, with no prefill leg.

Per policy it reports the prefix-hit share of each leg (blocks not recomputed, blocks not pushed),
bytes pushed, prefill tokens computed, TTFT p50/p99, SLO attainment and rejections (the cost model
refuses what it predicts over ``ttft_slo_ms``), and imbalance (the most loaded decode instance's
request-seconds over the mean). ``pooled`` is the ideal: one LRU of every receiver's blocks.

Trace format (Mooncake FAST'25): one JSON object per line, ``timestamp`` (ms), ``input_length``,
``output_length``, ``hash_ids`` (one per ``block_tokens`` block of the prompt). Pure: no clock, no I/O
but reading the trace.
"""

from __future__ import annotations

import heapq
import json
import statistics
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdpush.router import costmodel
from pdpush.router.placement import Candidate, Weights, choose_decode, choose_prefill

POLICIES = ("round_robin", "least_loaded", "decode_cache_aware", "cost_model")
MAX_LINE = 1 << 20


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace; a line that is not a request says which line and why (ValueError)."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if len(line) > MAX_LINE:
                raise ValueError(f"{path}:{no}: a line of {len(line)} bytes (at most {MAX_LINE})")
            try:
                o = json.loads(line)
                r = TraceRequest(float(o["timestamp"]), int(o["input_length"]), int(o["output_length"]),
                                 tuple(int(h) for h in o["hash_ids"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{no}: not a trace request ({type(e).__name__}: {e})") from None
            if r.input_length < 1 or r.output_length < 0 or not r.hash_ids:
                raise ValueError(f"{path}:{no}: a request needs input_length >= 1 and hash_ids")
            out.append(r)
            if limit and len(out) >= limit:
                break
    out.sort(key=lambda r: r.timestamp_ms)
    return out


@dataclass(frozen=True)
class SimConfig:
    prefill: int = 8
    decode: int = 8
    block_tokens: int = 512  # the trace's block; the receivers' chunk here
    pool_blocks: int = 0  # per receiver; 0: pool_share of the trace's unique blocks
    pool_share: float = 0.05
    prefill_cache_blocks: int = 0  # per prefill instance's own cache; 0: prefill_cache_share
    prefill_cache_share: float = 0.05
    prefill_tokens_per_s: float = 20_000.0
    bytes_per_s: float = 12.5e9  # into each receiver (100 Gb/s)
    kv_bytes_per_token: int = 327_680  # LLaMA-2-70B class: 80 layers x 8 KV heads x 128 x 2 x fp16
    layers: int = 80
    tpot_s: float = 0.03
    decode_slots: int = 32
    local_tokens_per_s: float = 0.0  # a decode instance's own prefill speed (conditional); 0: off
    max_inflight: int = 1 << 30
    max_imbalance: int = 4
    ttft_slo_ms: float | None = None


class LRU:
    """A cache of block ids with a capacity, least recently used out first."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.blocks = capacity, OrderedDict()

    def held(self, ids: tuple[int, ...]) -> int:
        """The longest leading run of ``ids`` held."""
        n = 0
        for h in ids:
            if h not in self.blocks:
                break
            n += 1
        return n

    def keep(self, ids: tuple[int, ...]) -> None:
        """Every block of ``ids`` is held now, the most recently used."""
        for h in ids:
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


@dataclass
class _Node:
    cache: LRU
    ends: list[float] = field(default_factory=list)  # heap: when each request in flight leaves it
    free_at: float = 0.0  # prefill: when its queue is done
    slots: list[float] = field(default_factory=list)  # decode: heap of when each slot frees
    busy_s: float = 0.0  # request-seconds

    def inflight(self, now: float) -> int:
        while self.ends and self.ends[0] <= now:
            heapq.heappop(self.ends)
        return len(self.ends)


def unique_blocks(trace: list[TraceRequest]) -> int:
    return len({h for r in trace for h in r.hash_ids})


def _capacity(cfg: SimConfig, trace: list[TraceRequest]) -> tuple[int, int]:
    u = unique_blocks(trace)
    pool = cfg.pool_blocks or max(1, int(cfg.pool_share * u))
    pre = cfg.prefill_cache_blocks or max(1, int(cfg.prefill_cache_share * u))
    return pool, pre


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def simulate(trace: list[TraceRequest], cfg: SimConfig, policy: str) -> dict:
    """One policy over the whole trace."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; policies: {', '.join(POLICIES)}")
    pool_blocks, pre_blocks = _capacity(cfg, trace)
    pre = [_Node(LRU(pre_blocks)) for _ in range(cfg.prefill)]
    dec = [_Node(LRU(pool_blocks), slots=[0.0] * cfg.decode_slots) for _ in range(cfg.decode)]
    weights = Weights(max_inflight=cfg.max_inflight, max_imbalance=cfg.max_imbalance)
    caps = costmodel.Caps(cfg.max_inflight, cfg.max_imbalance)
    chunk_bytes = cfg.block_tokens * cfg.kv_bytes_per_token
    slo_s = cfg.ttft_slo_ms / 1000 if cfg.ttft_slo_ms else None
    last_d = last_p = -1
    blocks = pre_hit = dec_hit = pushed = computed = rejected = 0
    ttft: list[float] = []
    for r in trace:
        now = r.timestamp_ms / 1000
        ids = r.hash_ids
        n = r.input_length
        p_in = [p.inflight(now) for p in pre]
        d_in = [d.inflight(now) for d in dec]
        p_held = [p.cache.held(ids) for p in pre]
        d_held = [d.cache.held(ids) for d in dec]
        pi: int | None
        if policy == "cost_model":
            prompt = costmodel.Prompt(n, cfg.block_tokens, chunk_bytes, cfg.layers)
            pc = [costmodel.PrefillCand(True, p_in[j], cfg.prefill_tokens_per_s,
                                        max(0.0, p.free_at - now) * cfg.prefill_tokens_per_s,
                                        p_held[j] * cfg.block_tokens) for j, p in enumerate(pre)]
            dcs = [costmodel.DecodeCand(True, d_in[j], cfg.bytes_per_s, d_held[j], max(0.0, d.slots[0] - now),
                                        cfg.local_tokens_per_s) for j, d in enumerate(dec)]
            plan = costmodel.choose(prompt, pc, dcs, caps, slo_s, last_p)
            if plan.best is None or plan.reason != "cost":
                rejected += 1
                continue
            pi, di = plan.best.prefill, plan.best.decode
        elif policy == "least_loaded":
            pi = min(range(cfg.prefill), key=lambda j: (p_in[j], (j - last_p - 1) % cfg.prefill))
            di = min(range(cfg.decode), key=lambda j: (d_in[j], (j - last_d - 1) % cfg.decode))
        else:
            pool_free = [pool_blocks - len(d.cache.blocks) for d in dec]
            dd = choose_decode([Candidate(True, d_in[j], d_held[j], pool_free[j], pool_blocks)
                                for j in range(cfg.decode)], len(ids), weights, last_d,
                               cache_aware=policy == "decode_cache_aware")
            if policy == "round_robin":
                pi = (last_p + 1) % cfg.prefill
            else:
                pi = choose_prefill([Candidate(True, p_in[j]) for j in range(cfg.prefill)], weights, last_p).index
            di = dd.index
            if di is None or pi is None:
                rejected += 1
                continue
        last_d = di
        d = dec[di]
        dheld = d_held[di]
        blocks += len(ids)
        dec_hit += dheld
        new = len(ids) - dheld
        if pi is None:  # the decode instance computes it, loading what its receiver holds
            held_tok = min(dheld * cfg.block_tokens, n - 1)
            c_tok = n - held_tok
            pre_hit += dheld
            ready = now + c_tok / cfg.local_tokens_per_s
            new = 0
        else:
            last_p = pi
            p = pre[pi]
            pheld = p_held[pi]
            held_tok = min(pheld * cfg.block_tokens, n - 1)
            c_tok = n - held_tok
            pre_hit += pheld
            start = max(now, p.free_at)
            compute = c_tok / cfg.prefill_tokens_per_s
            p.free_at = start + compute
            heapq.heappush(p.ends, p.free_at)
            p.busy_s += p.free_at - now
            push = new * chunk_bytes / cfg.bytes_per_s
            ready = p.free_at + max(push / cfg.layers, push - compute)
            p.cache.keep(ids)
        computed += c_tok
        pushed += new
        slot = heapq.heappop(d.slots)
        begin = max(ready, slot)
        first = begin + cfg.tpot_s
        end = begin + max(1, r.output_length) * cfg.tpot_s
        heapq.heappush(d.slots, end)
        heapq.heappush(d.ends, end)
        d.busy_s += end - now
        d.cache.keep(ids)
        ttft.append(first - now)
    served = len(ttft)
    busy = [d.busy_s for d in dec]
    mean = statistics.fmean(busy) if busy else 0.0
    return {
        "requests": len(trace), "served": served, "rejected": rejected,
        "prefill_hit_share": pre_hit / blocks if blocks else 0.0,
        "decode_hit_share": dec_hit / blocks if blocks else 0.0,
        "blocks_pushed": pushed, "bytes_pushed": pushed * chunk_bytes,
        "prefill_tokens": computed,
        "ttft_p50_ms": _pct(ttft, 0.5) * 1000, "ttft_p99_ms": _pct(ttft, 0.99) * 1000,
        "slo_attainment": (sum(t * 1000 <= cfg.ttft_slo_ms for t in ttft) / len(trace) if cfg.ttft_slo_ms
                           else None),
        "imbalance": max(busy) / mean if mean else 1.0,
    }


def pooled(trace: list[TraceRequest], cfg: SimConfig) -> dict:
    """The ideal decode leg: every receiver's blocks in one LRU, whatever the placement."""
    pool_blocks, _ = _capacity(cfg, trace)
    cache = LRU(pool_blocks * cfg.decode)
    blocks = hit = 0
    for r in trace:
        hit += cache.held(r.hash_ids)
        blocks += len(r.hash_ids)
        cache.keep(r.hash_ids)
    return {"decode_hit_share": hit / blocks if blocks else 0.0, "blocks": blocks}


def run(trace: list[TraceRequest], cfg: SimConfig, policies: tuple[str, ...] = POLICIES) -> dict:
    pool_blocks, pre_blocks = _capacity(cfg, trace)
    return {"config": {**asdict(cfg), "pool_blocks": pool_blocks, "prefill_cache_blocks": pre_blocks,
                       "unique_blocks": unique_blocks(trace)},
            "requests": len(trace),
            "policies": {p: simulate(trace, cfg, p) for p in policies},
            "pooled": pooled(trace, cfg)}


def markdown(res: dict, title: str = "") -> str:
    c = res["config"]
    rows = [f"### {title or 'pdpush simulate'}", "",
            f"{res['requests']} requests; {c['prefill']} prefill and {c['decode']} decode instances; "
            f"{c['pool_blocks']} blocks per receiver, {c['prefill_cache_blocks']} per prefill cache "
            f"(of {c['unique_blocks']} unique); {c['prefill_tokens_per_s']:,.0f} prefill tokens/s; "
            f"{c['bytes_per_s'] / 1e9:.1f} GB/s per receiver; TPOT {c['tpot_s'] * 1000:.0f} ms"
            + (f"; TTFT SLO {c['ttft_slo_ms']:.0f} ms" if c.get("ttft_slo_ms") else ""), "",
            "| policy | prefill hit | decode hit | bytes pushed | prefill tokens | TTFT p50 ms | TTFT p99 ms | "
            "SLO attained | rejected | imbalance |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in res["policies"].items():
        slo = f"{r['slo_attainment']:.3f}" if r["slo_attainment"] is not None else "-"
        rows.append(f"| {name} | {r['prefill_hit_share']:.3f} | {r['decode_hit_share']:.3f} | "
                    f"{r['bytes_pushed'] / 1e12:.2f} TB | {r['prefill_tokens']:,} | {r['ttft_p50_ms']:.0f} | "
                    f"{r['ttft_p99_ms']:.0f} | {slo} | {r['rejected']} | {r['imbalance']:.2f} |")
    rows.append(f"| pooled (ideal decode leg) | | {res['pooled']['decode_hit_share']:.3f} | | | | | | | |")
    return "\n".join(rows) + "\n"


def plot(res: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["policies"])
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    hits = [res["policies"][n]["decode_hit_share"] for n in names]
    axes[0].bar(names, hits, color="tab:blue")
    axes[0].axhline(res["pooled"]["decode_hit_share"], color="k", ls="--", label="pooled")
    axes[0].set_title("decode-leg prefix-hit share")
    axes[0].legend()
    axes[1].bar(names, [res["policies"][n]["prefill_tokens"] / 1e6 for n in names], color="tab:orange")
    axes[1].set_title("prefill tokens computed (M)")
    p50 = [res["policies"][n]["ttft_p50_ms"] for n in names]
    p99 = [res["policies"][n]["ttft_p99_ms"] for n in names]
    x = range(len(names))
    axes[2].bar([i - 0.2 for i in x], p50, 0.4, label="p50")
    axes[2].bar([i + 0.2 for i in x], p99, 0.4, label="p99")
    axes[2].set_xticks(list(x), names)
    axes[2].set_yscale("log")
    axes[2].set_title("TTFT (ms)")
    axes[2].legend()
    for a in axes:
        a.tick_params(axis="x", labelrotation=25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
