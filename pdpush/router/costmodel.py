"""One cost model for both legs of a request: its predicted time to first token on each (prefill,
decode) pair, and on each decode instance alone (conditional disaggregation), and the cheapest under
load caps. Pure logic: no I/O, no clock; the router and ``pdpush simulate`` (simulate.py) both call it.

For a prompt of ``n`` tokens on prefill instance ``p`` and decode instance ``d``:

    queue(p)    = pending(p) / speed(p)                 work already in flight there, at its speed
    compute(p)  = overhead(p) + (n - held(p)) / speed(p)  the tokens its own cache does not hold
    push(d)     = new_chunks(d) * chunk_bytes / bw(d)   the chunks d's receiver does not hold
    exposed(d)  = max(push(d) / layers, push(d) - compute(p))   layers stream while the prefill computes
    TTFT(p, d)  = queue(p) + compute(p) + exposed(d) + wait(d)

``wait(d)`` is the decode instance's own delay before it starts the request (``wait_s``: its
requests in flight times a per-request cost). With no prefill leg, ``d`` loads the chunks its
receiver holds and computes the rest itself at its own speed: ``TTFT(-, d) = wait(d) + (n -
held(d)) / local_speed(d)`` (``local_tokens_per_s`` 0: not offered). The prefill computes at least
one token, so a fully held prompt still costs one.

Load caps keep affinity from piling onto one instance: an instance is a candidate only while it has
fewer than ``max_inflight`` in flight and at most ``max_imbalance`` more than the least loaded of its
role. With ``slo_s`` set, a best prediction over it is ``reason = "slo"``: the router refuses it.

``Estimates`` holds the speeds: a prefill instance's is learned online from the legs the router sees it
run alone (a leg that shared the instance says little about either), as a line through the legs' times
against their tokens (exponentially weighted least squares): its slope the speed, its intercept the
per-leg overhead, once the legs seen differ enough in length to tell them apart (before, tokens over
time). An instance not measured yet takes the mean of those that are, not the configured default (a
default that flatters it would pull requests away from the instances holding their prefixes), and one
measured on few legs is drawn towards that mean (one slow leg must not keep it out of placement). Push
bandwidth and a decode instance's own prefill speed stay as configured until something measures them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdpush.router.placement import eligible


@dataclass(frozen=True)
class Prompt:
    tokens: int
    chunk_tokens: int  # the receivers' chunk
    chunk_bytes: int  # one chunk's KV, every layer
    layers: int = 1  # layers that stream (the exposed transfer is at least one layer's)


@dataclass(frozen=True)
class PrefillCand:
    healthy: bool
    inflight: int
    tokens_per_s: float
    pending_tokens: float = 0.0  # tokens of the requests in flight there, not computed yet
    held_tokens: int = 0  # leading prompt tokens its own prefix cache holds (0 where unknown)
    overhead_s: float = 0.0  # a leg's cost whatever its length (scheduling, the sampled token, HTTP)


@dataclass(frozen=True)
class DecodeCand:
    healthy: bool
    inflight: int
    bytes_per_s: float  # pushes into its receiver
    held_chunks: int = 0  # leading prompt chunks its receiver holds
    wait_s: float = 0.0  # its delay before it starts the request
    local_tokens_per_s: float = 0.0  # its own prefill speed, for a request with no prefill leg (0: never)


@dataclass(frozen=True)
class Estimate:
    """One candidate's predicted TTFT and its parts (seconds)."""

    prefill: int | None  # None: no prefill leg, the decode instance computes the prompt
    decode: int
    ttft_s: float
    queue_s: float
    compute_s: float
    transfer_s: float  # exposed
    wait_s: float
    computed_tokens: int
    pushed_chunks: int


@dataclass(frozen=True)
class Caps:
    max_inflight: int = 16
    max_imbalance: int = 4
    # Among candidates within this much of the least TTFT (the larger of a fraction and seconds), the one that
    # pushes the fewest chunks wins: a transfer hidden behind the prefill's compute still takes the network.
    near_frac: float = 0.05
    near_s: float = 0.005


@dataclass(frozen=True)
class Plan:
    best: Estimate | None  # None: no candidate (reason says why)
    reason: str  # cost | slo | saturated | no_healthy
    candidates: int = 0


def predict(prompt: Prompt, p: PrefillCand | None, d: DecodeCand, pi: int | None = None, di: int = 0) -> Estimate:
    """The TTFT of ``prompt`` on ``p`` then ``d`` (``p`` None: ``d`` alone)."""
    n = prompt.tokens
    chunks = -(-n // prompt.chunk_tokens)
    held_d = min(d.held_chunks, chunks)
    if p is None:
        held = min(held_d * prompt.chunk_tokens, n - 1) if n else 0
        compute = (n - held) / d.local_tokens_per_s if d.local_tokens_per_s > 0 else math.inf
        return Estimate(None, di, d.wait_s + compute, 0.0, compute, 0.0, d.wait_s, n - held, 0)
    held = min(p.held_tokens, n - 1) if n else 0
    queue = p.pending_tokens / p.tokens_per_s
    compute = p.overhead_s + (n - held) / p.tokens_per_s
    new = chunks - held_d
    push = new * prompt.chunk_bytes / d.bytes_per_s if new else 0.0
    exposed = max(push / max(prompt.layers, 1), push - compute)
    return Estimate(pi, di, queue + compute + exposed + d.wait_s, queue, compute, exposed, d.wait_s, n - held, new)


def choose(prompt: Prompt, prefills: list[PrefillCand], decodes: list[DecodeCand], caps: Caps,
           slo_s: float | None = None, last_prefill: int = -1) -> Plan:
    """The pair (or decode instance alone) of least predicted TTFT among those within the load caps, or,
    among those near it (``Caps.near_*``), the one pushing the fewest chunks; ties go to fewer in flight
    on the decode side, then the prefill side, then the lower decode index, then the prefill instances in
    turn after ``last_prefill`` (idle instances alike share cold prompts, rather than the first taking all)."""
    dok, why = eligible([d.healthy for d in decodes], [d.inflight for d in decodes], caps.max_inflight,
                        caps.max_imbalance)
    if not dok:
        return Plan(None, why)
    pok, pwhy = eligible([p.healthy for p in prefills], [p.inflight for p in prefills], caps.max_inflight,
                         caps.max_imbalance)
    cands = [predict(prompt, prefills[i], decodes[j], i, j) for j in dok for i in pok]
    cands += [predict(prompt, None, decodes[j], None, j) for j in dok
              if decodes[j].local_tokens_per_s > 0 and decodes[j].held_chunks > 0]
    if not cands:
        return Plan(None, pwhy or "saturated")

    def key(e: Estimate):
        return (e.ttft_s, decodes[e.decode].inflight, -1 if e.prefill is None else prefills[e.prefill].inflight,
                e.decode, -1 if e.prefill is None else (e.prefill - last_prefill - 1) % len(prefills))

    fastest = min(cands, key=key)
    if slo_s is not None and fastest.ttft_s > slo_s:
        return Plan(fastest, "slo", len(cands))
    near = fastest.ttft_s + max(caps.near_s, caps.near_frac * fastest.ttft_s)
    if slo_s is not None:
        near = min(near, slo_s)
    best = min((e for e in cands if e.ttft_s <= near), key=lambda e: (e.pushed_chunks, key(e)))
    return Plan(best, "cost", len(cands))


@dataclass
class Estimates:
    """Speeds learned online, per instance (by name), from what the router observes; the defaults
    stand until the first observation. ``alpha`` weighs each new sample."""

    prefill_tokens_per_s: float = 20_000.0
    push_bytes_per_s: float = 5e9
    decode_wait_s_per_request: float = 0.002
    local_tokens_per_s: float = 0.0  # 0: conditional disaggregation off
    alpha: float = 0.2
    prior_legs: float = 2.0  # how many legs the fleet's mean weighs in an instance's prefill fit
    prefill: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (tokens/s, overhead s)
    _fits: dict[str, list[float]] = field(default_factory=dict)  # name -> weighted sums w, x, y, xx, xy
    push: dict[str, float] = field(default_factory=dict)
    local: dict[str, float] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)

    def _fold(self, table: dict[str, float], name: str, sample: float) -> None:
        if not (sample > 0 and math.isfinite(sample)):
            return
        old = table.get(name)
        table[name] = sample if old is None else old + self.alpha * (sample - old)
        self.samples[name] = self.samples.get(name, 0) + 1

    def prefill_speed(self, name: str) -> float:
        return self._prefill_fit(name)[0]

    def prefill_overhead(self, name: str) -> float:
        return self._prefill_fit(name)[1]

    def _prefill_fit(self, name: str) -> tuple[float, float]:
        """An instance's own fit, drawn towards the fleet's mean while it rests on few legs (``prior_legs``
        of weight): one leg slowed by a transient must not keep an instance out of placement, since it is
        measured again only when chosen. Not measured yet: the fleet's mean; nothing measured: the default."""
        if not self.prefill:
            return self.prefill_tokens_per_s, 0.0
        n = len(self.prefill)
        per_token = sum(1.0 / v[0] for v in self.prefill.values()) / n
        overhead = sum(v[1] for v in self.prefill.values()) / n
        own = self.prefill.get(name)
        if own is not None:
            w = self.samples.get(name, 0) / (self.samples.get(name, 0) + self.prior_legs)
            per_token = w / own[0] + (1 - w) * per_token
            overhead = w * own[1] + (1 - w) * overhead
        return 1.0 / per_token, overhead

    def forget(self, name: str) -> None:
        """An instance dropped from the fleet: what was learned there goes (its fit would otherwise weigh in the
        fleet's mean, the estimate of every instance not measured yet, for the router's life)."""
        for table in (self.prefill, self._fits, self.push, self.local, self.samples):
            table.pop(name, None)

    def push_speed(self, name: str) -> float:
        return self.push.get(name, self.push_bytes_per_s)

    def local_speed(self, name: str) -> float:
        return self.local.get(name, self.local_tokens_per_s) if self.local_tokens_per_s > 0 else 0.0

    def observe_prefill(self, name: str, computed_tokens: int, pending_tokens: float, seconds: float) -> None:
        """A prefill leg that computed ``computed_tokens`` with ``pending_tokens`` ahead of it took
        ``seconds``: its instance worked through both in that time."""
        x = computed_tokens + pending_tokens
        if not (seconds > 0 and x > 0 and math.isfinite(seconds) and math.isfinite(x)):
            return
        f = self._fits.setdefault(name, [0.0] * 5)
        keep = 1.0 - self.alpha if f[0] else 0.0
        for i, v in enumerate((1.0, x, seconds, x * x, x * seconds)):
            f[i] = f[i] * keep + v
        self.samples[name] = self.samples.get(name, 0) + 1
        w, sx, sy, sxx, sxy = f
        mx, my = sx / w, sy / w
        var, cov = sxx / w - mx * mx, sxy / w - mx * my
        speed, overhead = sx / sy, 0.0  # one length seen so far: tokens over time
        if var > (0.1 * mx) ** 2 and cov > 0:  # lengths that differ: the line's slope and intercept
            slope = cov / var
            if my - slope * mx > 0:
                speed, overhead = 1.0 / slope, my - slope * mx
        self.prefill[name] = (speed, overhead)

    def observe_push(self, name: str, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            self._fold(self.push, name, nbytes / seconds)

    def observe_local(self, name: str, computed_tokens: int, seconds: float) -> None:
        if seconds > 0 and self.local_tokens_per_s > 0:
            self._fold(self.local, name, computed_tokens / seconds)

    def decode_wait(self, inflight: int) -> float:
        return inflight * self.decode_wait_s_per_request
