"""Where a request goes: the decode instance (cache-aware, load-weighed), the prefill instance (least
loaded), and whether the prefill leg is needed at all. Pure logic: no I/O, no clock.

The decode score (docs/operations.md, "The router"): for each eligible decode instance ``d``,

    score(d) = hit(d) / chunks  -  w_load * inflight(d) / max_inflight  -  w_pool * (1 - free(d) / total(d))

``hit(d)`` is how many leading chunks of the prompt d's receiver holds (from its chunk-index
feed), ``inflight(d)`` the requests the router has in flight there, and ``free/total`` its
receiver's free pool pages. The highest score wins; ties go to fewer in flight, then to the
instance after the last one chosen.

Eligible: healthy, fewer than ``max_inflight`` in flight (saturated otherwise), and at most
``max_imbalance`` more in flight than the least-loaded healthy instance. That last rule is what
keeps cache affinity from piling a hot prefix onto one node: under skewed traffic a node takes at
most ``max_imbalance`` requests more than the idlest one, whatever it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Weights:
    load: float = 1.0
    pool: float = 0.5
    max_inflight: int = 16
    max_imbalance: int = 4


@dataclass(frozen=True)
class Candidate:
    healthy: bool
    inflight: int
    hit_chunks: int = 0
    pages_free: int | None = None  # None: unknown (no index feed)
    pages_total: int | None = None


@dataclass(frozen=True)
class Decision:
    index: int | None  # None: every instance is down or saturated
    reason: str  # prefix_hit | load | affinity_capped | round_robin | saturated | no_healthy
    score: float = 0.0
    hit_chunks: int = 0
    best_hit_chunks: int = 0  # the most any instance held, chosen or not


def eligible(healthy: Sequence[bool], inflight: Sequence[int], max_inflight: int,
             max_imbalance: int) -> tuple[list[int], str]:
    """The load caps (this router's and the cost model's): healthy, fewer than ``max_inflight`` in flight,
    and at most ``max_imbalance`` more than the least loaded such instance; else why none is."""
    ok = [i for i, h in enumerate(healthy) if h]
    if not ok:
        return [], "no_healthy"
    ok = [i for i in ok if inflight[i] < max_inflight]
    if not ok:
        return [], "saturated"
    least = min(inflight[i] for i in ok)
    return [i for i in ok if inflight[i] <= least + max_imbalance], ""


def _eligible(cands: list[Candidate], w: Weights) -> tuple[list[int], str]:
    return eligible([c.healthy for c in cands], [c.inflight for c in cands], w.max_inflight, w.max_imbalance)


def score(c: Candidate, chunks: int, w: Weights) -> float:
    hit = c.hit_chunks / chunks if chunks else 0.0
    full = 0.0 if not c.pages_total or c.pages_free is None else 1.0 - c.pages_free / c.pages_total
    return hit - w.load * c.inflight / w.max_inflight - w.pool * full


def _after(i: int, last: int, n: int) -> int:
    """Distance from the last chosen, for round-robin tie-breaking."""
    return (i - last - 1) % n


def choose_decode(cands: list[Candidate], chunks: int, w: Weights, last: int = -1,
                  cache_aware: bool = True) -> Decision:
    ok, why = _eligible(cands, w)
    if not ok:
        return Decision(None, why)
    best_hit = max(c.hit_chunks for c in cands if c.healthy)
    n = len(cands)
    if not cache_aware:
        i = min(ok, key=lambda i: _after(i, last, n))
        return Decision(i, "round_robin", 0.0, cands[i].hit_chunks, best_hit)
    i = max(ok, key=lambda i: (score(cands[i], chunks, w), -cands[i].inflight, -_after(i, last, n)))
    c = cands[i]
    if c.hit_chunks and c.hit_chunks == best_hit:
        reason = "prefix_hit"
    elif best_hit > c.hit_chunks:
        reason = "affinity_capped"  # a node holding more was too loaded (or ineligible)
    else:
        reason = "load"
    return Decision(i, reason, score(c, chunks, w), c.hit_chunks, best_hit)


def choose_prefill(cands: list[Candidate], w: Weights, last: int = -1) -> Decision:
    """The least-loaded healthy, unsaturated prefill instance; ties round-robin."""
    ok, why = _eligible(cands, Weights(w.load, w.pool, w.max_inflight, max_imbalance=1 << 30))
    if not ok:
        return Decision(None, why)
    n = len(cands)
    i = min(ok, key=lambda i: (cands[i].inflight, _after(i, last, n)))
    return Decision(i, "least_loaded")


def local_prefill(prompt_tokens: int, hit_chunks: int, chunk_tokens: int, max_tokens: int) -> bool:
    """Conditional disaggregation: the decode instance computes the prompt itself, loading the held
    prefix from its receiver, when all but at most ``max_tokens`` of the prompt is held there."""
    if max_tokens <= 0 or hit_chunks == 0:
        return False
    return prompt_tokens - min(prompt_tokens, hit_chunks * chunk_tokens) <= max_tokens


@dataclass(frozen=True)
class Legs:
    """Where a request's two legs go under the score-based policies (``plan_legs``)."""

    decode: Decision  # index None: no decode instance can take it
    prefill: Decision | None  # None: no prefill leg (the decode computes the prompt itself, or no decode)
    local: bool = False  # the decode computes the prompt, loading the held prefix (``local_prefill``)


def plan_legs(decodes: list[Candidate], prefills: list[Candidate], chunks: int, w: Weights, *, last_decode: int = -1,
              last_prefill: int = -1, cache_aware: bool = True, prompt_tokens: int = 0, chunk_tokens: int | None = None,
              local_prefill_max_tokens: int = 0) -> Legs:
    """The decode instance first (``choose_decode``); then, where the cache-aware policy finds nearly all of the
    prompt held there, no prefill leg at all (``local_prefill``); else the least-loaded prefill instance."""
    dd = choose_decode(decodes, chunks, w, last_decode, cache_aware=cache_aware)
    if dd.index is None:
        return Legs(dd, None)
    if chunk_tokens is not None and cache_aware and local_prefill(prompt_tokens, dd.hit_chunks, chunk_tokens,
                                                                  local_prefill_max_tokens):
        return Legs(dd, None, local=True)
    return Legs(dd, choose_prefill(prefills, w, last_prefill))
