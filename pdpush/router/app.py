"""``pdpush router``: an OpenAI-compatible front for N prefill and M decode vLLM instances.

For each completion (``/v1/completions``, ``/v1/chat/completions``, streamed or not):
  1. the prompt's token ids (tokens.py) give its chunk keys, and each decode receiver's index
     (feeds.py) how many leading chunks it holds;
  2. placement.py picks the decode instance (held prefix weighed against load) and, unless the
     chosen one holds all but ``local_prefill_max_tokens`` of the prompt (then it claims the held
     chunks and computes the rest itself: no prefill, no push), the least-loaded prefill instance;
     or, with ``policy = "cost_model"``, costmodel.py predicts every (prefill, decode) pair's time to
     first token (the prefill engines' own caches followed from their vLLM KV events, kv_events.py)
     and takes the least, refusing with 429 what would miss ``ttft_slo_ms``;
  3. the router makes the push id (``<prefix>-<uuid>``; a client's ``kv_transfer_params`` are
     dropped, so no client can name or reuse one) and sends the prefill leg (``max_tokens = 1``, push
     to the decode's receiver) and the decode leg: at once (the decode loads each layer as it
     lands), or one after the other;
  4. relays the decode instance's answer.

Failures: a prefill that cannot be reached is retried once on another instance (same push id),
else the decode instance recomputes (its connector does when no push arrives). A decode instance
that cannot be reached is ejected and the request goes to another, recomputing. Nothing is relayed
as a 200 unless the decode instance answered 200. Every upstream call has a deadline; bodies are
capped; when every instance is saturated the answer is 503 with Retry-After.

SIGHUP reads the config file again and takes its new instance lists (reload.py decides what is added, dropped
after its requests in flight, and kept with its state); a config it cannot take is refused and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import signal
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdpush import config as cfgmod
from pdpush import kv_params
from pdpush.config import RouterConfig
from pdpush.errors import ConfigError
from pdpush.layout import KVLayout, chunk_keys
from pdpush.router import costmodel, legs, reload
from pdpush.router.engine_cache import EngineCacheView
from pdpush.router.fleet import Fleet, Instance
from pdpush.router.metrics import Metrics
from pdpush.router.placement import Candidate, Weights, choose_decode, plan_legs
from pdpush.router.tokens import (
    TOKENIZE_TIMEOUT_S,
    EngineTokens,
    LocalTokens,
    PromptError,
    check_prompt,
    prompt_extras,
)
from pdpush.router.watch import Watches

log = logging.getLogger("pdpush.router")


class StreamCut(Exception):
    """A streamed answer its decode instance broke off: raised out of the relay, so that the ASGI server breaks the
    client's connection off too (no final chunk), rather than end the stream as if it were whole."""


class ClientStalled(StreamCut):
    """A streamed answer's client took no part of it within ``client_write_timeout_s`` (connected, not reading: a
    process suspended, a consumer stuck). Its connection is broken off, and the decode leg's with it (its engine
    aborts the request): otherwise the relay waited on the client's window for good, counted in flight, and
    ``max_inflight`` such clients made the router answer 503 for good."""


class _Relayed(StreamingResponse):
    """A streamed answer whose client must take each part within ``write_timeout_s`` (``ClientStalled``); its relay
    is closed however it ends (its ``finally`` gives its counts back and closes the decode leg's connection)."""

    def __init__(self, content, write_timeout_s: float, on_stall, **kw) -> None:
        super().__init__(content, **kw)
        self.write_timeout_s, self.on_stall = write_timeout_s, on_stall

    async def stream_response(self, send) -> None:
        async def timed(message) -> None:
            try:
                async with asyncio.timeout(self.write_timeout_s):
                    await send(message)
            except TimeoutError:
                self.on_stall()
                raise ClientStalled(f"no part taken within {self.write_timeout_s} s") from None

        try:
            await super().stream_response(timed)
        finally:
            await self.body_iterator.aclose()


def _not_a_cut(record: logging.LogRecord) -> bool:
    """uvicorn's log filter: its "Exception in ASGI application" for a StreamCut (the relay logged the cut, once,
    as the decode's failure) goes unlogged; the router's own errors still come with their traceback."""
    exc = record.exc_info[1] if record.exc_info else None
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:  # (an anyio task group's wrapping)
        exc = exc.exceptions[0]
    return not isinstance(exc, StreamCut)

COMPLETIONS = ("/v1/completions", "/v1/chat/completions")


def _gone(e: Exception) -> bool:
    """Whether an upstream call's failure says the engine is gone: nothing listens at its address, or the DNS says
    its name does not exist. A name the DNS did not answer (a server down or slow: EAI_AGAIN, SERVFAIL) says nothing
    of the engine, which may be serving on: its instance fails softly (``eject_after`` checks in a row) and keeps
    its cache view."""
    if not isinstance(e, httpx.ConnectError):
        return False
    x: BaseException | None = e
    for _ in range(8):  # httpx wraps httpcore's error, which wraps the OSError
        if x is None:
            break
        if isinstance(x, socket.gaierror):
            return x.errno in _NO_SUCH_NAME
        x = x.__cause__ or x.__context__
    return True


_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def error(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


async def _hung_up(request: Request) -> None:
    """Returns once the client has closed its connection (its body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class Route_:
    """One request's placement."""

    decode: Instance
    prefill: Instance | None  # None: conditional (the decode instance computes the prompt)
    push_id: str
    prompt_tokens: int
    hit_chunks: int
    reason: str
    estimate: costmodel.Estimate | None = None  # cost_model: the prediction it was chosen by
    prefill_served: Instance | None = None  # the instance whose prefill leg pushed (another one after a retry)
    # a prefill leg that may have reached its engine and gone unanswered (a broken answer, a timeout, a gateway's 502
    # or 504): its push may still come, so it is not withdrawn (a refused connection or the engine's error is sure)
    prefill_unsure: bool = False
    # a decode leg naming the push reached its engine (its request's headers began to go out), which has not failed
    # it: the push is that engine's to read, or its connector's to withdraw; else the router tells the receiver
    # itself (_withdraw_unread)
    decode_took: bool = False
    # one leg after the other, every prefill try surely pushed nothing (refused, an error status, no connection)
    unpushed: bool = False


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        # fleet.prefill[i] and fleet.decode[i] are made from cfg.prefill[i] and cfg.decode[i], reloads included
        self.fleet = Fleet([self._instance(k) for k in reload.prefill_keys(cfg)],
                           [self._instance(k) for k in reload.decode_keys(cfg)], eject_after=cfg.eject_after)
        self.weights = Weights(cfg.weight_load, cfg.weight_pool, cfg.max_inflight, cfg.max_imbalance)
        self.prefix = cfg.push_id_prefix or f"rt-{secrets.token_hex(4)}"
        try:
            self.api_key = Path(cfg.api_key_file).read_text().strip() if cfg.api_key_file else None
        except (OSError, UnicodeDecodeError) as e:  # (a setting: exit 2, not a start-up failure to retry)
            raise ConfigError(f"api_key_file: cannot read {cfg.api_key_file}: {e}") from None
        self.tokens = LocalTokens(cfg.tokenizer) if cfg.tokenizer != "engine" else EngineTokens()
        self.metrics = Metrics()
        self._last_decode = self._last_prefill = -1
        self._tokenize_turn = 0  # which healthy prefill instance's /tokenize is asked first, in turn
        self._tasks: list[asyncio.Task] = []
        self._legs: set[asyncio.Task] = set()  # concurrent prefill legs still running
        self.watches = Watches(cfg.index_silence_s, self._feed_changed, self._withdrawn, cfg.name_recheck_s)
        self._started = False
        self.last_reload = ""  # what the last SIGHUP did (counted by outcome in /metrics)
        self.client: httpx.AsyncClient | None = None
        self.health_client: httpx.AsyncClient | None = None
        self.counters = {"requests": 0, "pushed": 0, "conditional": 0, "recomputed": 0, "prefill_retries": 0,
                         "decode_retries": 0, "rejected_503": 0, "rejected_slo": 0, "withdraw_sent": 0,
                         "withdrawn": 0, "withdraw_unsent": 0, "prefill_cancelled": 0, "unread_sent": 0,
                         "unread_unsent": 0}
        self.estimates = costmodel.Estimates(cfg.prefill_tokens_per_s, cfg.push_gbps * 1e9,
                                             cfg.decode_wait_ms_per_request / 1000, cfg.local_tokens_per_s)
        self.caps = costmodel.Caps(cfg.max_inflight, cfg.max_imbalance)

    @staticmethod
    def _instance(key: reload.PrefillKey | reload.DecodeKey) -> Instance:
        if isinstance(key, reload.DecodeKey):
            return Instance("decode", key.url, key.receiver)
        return Instance("prefill", key.url, cache=EngineCacheView() if key.events else None)

    # ---- lifecycle ----
    async def start(self) -> None:
        c = self.cfg
        timeout = httpx.Timeout(c.upstream_timeout_s, connect=c.connect_timeout_s, pool=c.connect_timeout_s)
        # a transport of its own: httpx then ignores HTTP_PROXY and the like (set for pip in many images), which
        # would take the legs through a proxy that breaks them or answers for an engine with its own 502 or 504;
        # SSL_CERT_FILE and SSL_CERT_DIR still count (trust_env=False would drop them too)
        limits = httpx.Limits(max_connections=c.max_upstream_connections, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=timeout, transport=httpx.AsyncHTTPTransport(limits=limits))
        # the health checks' own connections: with the legs' pool full of long streams, checks that waited for it
        # timed out, and every engine, healthy, was ejected (every request then 503, no_healthy)
        self.health_client = httpx.AsyncClient(timeout=timeout, transport=httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=256)))
        if c.curve_secret_key_file:
            self.watches.load_keypair(c.curve_secret_key_file)
        for p, pk in zip(self.fleet.prefill, reload.prefill_keys(c), strict=True):
            self.watches.start(p, pk)
        for d, dk in zip(self.fleet.decode, reload.decode_keys(c), strict=True):
            self.watches.start(d, dk, self.watches.configure(dk))
        self._tasks.append(asyncio.create_task(self._health_loop(), name="health"))
        self._started = True

    async def stop(self) -> None:
        for t in list(self._legs) + self._tasks:
            t.cancel()
        for t in list(self._legs) + self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.watches.close()
        if self.client is not None:
            await self.client.aclose()
        if self.health_client is not None:
            await self.health_client.aclose()

    def _feed_changed(self, d: Instance, kind: str) -> None:
        if kind == "snapshot" and d.index.resyncs:
            self.metrics.index_resyncs.labels(d.receiver).inc()

    # ---- reload (SIGHUP) ----
    def sighup(self) -> None:
        """Read the config file again and take its instance lists; a file that does not load is refused."""
        try:
            new = cfgmod.reload(self.cfg)
        except ConfigError as e:
            self._reloaded("refused", f"refused: {e}")
            return
        self.take(new)

    def take(self, new: RouterConfig) -> reload.Plan:
        """Apply a config read again: what reload.plan says, or nothing where it refuses it."""
        plan = reload.plan(self.cfg, new)
        configure = {}
        if not plan.refused and self._started:
            try:  # the new receivers' keys, read before anything changes
                configure = {k: self.watches.configure(k) for k in plan.decode.added}
            except ConfigError as e:
                plan = reload.Plan(plan.prefill, plan.decode, plan.restart_only, str(e))
        if plan.refused or not plan.changed:
            self._reloaded("refused" if plan.refused else "unchanged", plan.summary())
            return plan
        lists = []
        for old, d in ((self.fleet.prefill, plan.prefill), (self.fleet.decode, plan.decode)):
            lists.append([old[i] if i is not None else self._instance(k) for k, i in zip(d.new, d.source, strict=True)])
        gone = [self.fleet.prefill[i] for i in plan.prefill.drop] + [self.fleet.decode[i] for i in plan.decode.drop]
        self.fleet.replace(lists[0], lists[1], gone)
        self.cfg = self.cfg.model_copy(update={f: getattr(new, f) for f in reload.LISTS})
        for inst in gone:
            self.watches.stop(inst)
            if inst.inflight > 0:
                log.warning("draining %s: dropped once its %d requests in flight end", inst.name, inst.inflight)
        if self._started:  # else start() subscribes to what is listed then
            for inst, k in zip(lists[0], plan.prefill.new, strict=True):
                if k in plan.prefill.added:
                    self.watches.start(inst, k)
            for inst, k in zip(lists[1], plan.decode.new, strict=True):
                if k in configure:
                    self.watches.start(inst, k, configure[k])
        self._reloaded("applied", plan.summary())
        self._reap()
        return plan

    def _reloaded(self, outcome: str, line: str) -> None:
        self.last_reload = f"{outcome}: {line}" if outcome != "refused" else line
        self.metrics.reloads.labels(outcome).inc()
        level = {"refused": logging.ERROR, "applied": logging.WARNING}.get(outcome, logging.INFO)
        kept = (f"; the {len(self.fleet.prefill)} prefill and {len(self.fleet.decode)} decode instances listed "
                "before stay" if outcome == "refused" else "")
        log.log(level, "reload (SIGHUP) %s%s", line, kept, extra={"fields": {"event": "reload", "outcome": outcome}})
        src = self.cfg._source[1] if self.cfg._source else {}
        for role in ("prefill", "decode"):
            if role in src or f"PDPUSH_{role.upper()}" in os.environ:
                log.warning("reload: %s comes from a flag or PDPUSH_%s, which win over the file: its list there is "
                            "not read", role, role.upper())

    def _reap(self) -> None:
        """Forget the dropped instances whose requests in flight have ended: their metrics' series and the speeds
        learned there (a URL no instance still has)."""
        for inst in self.fleet.reap():
            log.warning("dropped %s: no request in flight there any more", inst.name,
                        extra={"fields": {"event": "dropped", "instance": inst.url}})
            m, live = self.metrics, self.fleet.all() + self.fleet.retired
            series = []
            if not any(i.url == inst.url for i in live):
                series += [(m.healthy, inst.url), (m.inflight, inst.url), (m.prefill_view_blocks, inst.url),
                           (m.upstream_errors, inst.url)]
                for why in (inst.cache.resyncs if inst.cache is not None else ()):
                    series.append((m.prefill_view_resyncs, (inst.url, why)))
                self.estimates.forget(inst.url)  # nor does its speed weigh in the fleet's mean any more
            if inst.role == "decode" and not any(i.receiver == inst.receiver for i in live if i.role == "decode"):
                series += [(m.index_chunks, inst.receiver), (m.index_synced, inst.receiver),
                           (m.index_resyncs, inst.receiver)]
            for metric, label in series:
                with contextlib.suppress(KeyError):  # never set (no scrape while it was listed)
                    metric.remove(*(label if isinstance(label, tuple) else (label,)))

    # ---- health ----
    async def _health_loop(self) -> None:
        while True:
            try:
                self._reap()
            except Exception:  # noqa: BLE001 - the health checks go on whatever the bookkeeping's bug
                log.exception("forgetting dropped instances")
            await asyncio.gather(*(self._check(i) for i in self.fleet.all()), return_exceptions=True)
            await asyncio.sleep(self.cfg.health_interval_s)

    async def _check(self, inst: Instance) -> None:
        try:
            r = await self.health_client.get(inst.url + "/health",
                                             timeout=min(5.0, 2 * self.cfg.health_interval_s + 1))
            ok, why = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, why = False, f"/health: {type(e).__name__}: {e}"
            self._maybe_gone(inst, e)
        if ok:
            if self.fleet.ok(inst):
                log.warning("re-admitted %s", inst.name, extra={"fields": {"event": "readmit", "instance": inst.url}})
        elif self.fleet.failed(inst, why):
            log.warning("ejected %s: %s", inst.name, why, extra={"fields": {"event": "eject", "instance": inst.url,
                                                                           "why": why}})

    def _maybe_gone(self, inst: Instance, e: Exception) -> None:
        """Nothing listens where a prefill engine was (``_gone``): it stopped, and whatever comes back there starts
        with an empty cache. Its view is cleared now (counted, ``unreachable``), not when the new engine's first
        event batch shows its sequence began again: until then placement would claim hits on blocks that
        are gone (a conversation's next turn sent back to an engine that lost its history)."""
        if _gone(e) and inst.cache is not None and inst.cache.by_hash:
            log.warning("%s is unreachable: its cache view is cleared", inst.name)
            inst.cache.clear("unreachable")

    def _unreachable(self, inst: Instance, e: Exception) -> None:
        if isinstance(e, httpx.PoolTimeout):  # the router's own connections were all in use: the engine was not asked
            return
        self.metrics.upstream_errors.labels(inst.url).inc()
        self._maybe_gone(inst, e)
        hard = _gone(e)
        if self.fleet.failed(inst, f"{type(e).__name__}: {e}", hard=hard):
            log.warning("ejected %s: %s", inst.name, e, extra={"fields": {"event": "eject", "instance": inst.url,
                                                                         "why": str(e)}})

    # ---- placement ----
    def _layout(self) -> KVLayout | None:
        for d in self.fleet.decode:
            if d.index.synced and d.index.layout is not None:
                return d.index.layout.kv_layout
        return None

    def place(self, ids: list[int] | None, exclude: Instance | None = None,
              extra: Sequence[bytes] | None = ()) -> Route_ | JSONResponse:
        """Where to run a prompt of token ids ``ids`` (None: not known). ``extra``: its chunks' extra keys
        (``tokens.prompt_extras``; None where the router cannot tell them: no hits are counted)."""
        layout = self._layout()
        keys = chunk_keys(ids, layout, extra) if ids and layout is not None and extra is not None else []
        if self.cfg.policy == "cost_model":
            # (an engine's own cache is seen through vLLM's events of blocks with no extra keys: kv_events.py)
            return self._place_by_cost(ids or [], layout, keys, exclude, cached=extra is not None and not extra)
        decodes = [Candidate(d.healthy and d is not exclude, d.inflight, d.index.held_prefix(keys) if keys else 0,
                             d.index.load.pages_free if d.index.load and d.index.synced else None,
                             d.index.load.pages_total if d.index.load and d.index.synced else None)
                   for d in self.fleet.decode]
        n = len(ids) if ids else 0
        legs = plan_legs(decodes, [Candidate(p.healthy, p.inflight) for p in self.fleet.prefill], len(keys),
                         self.weights, last_decode=self._last_decode, last_prefill=self._last_prefill,
                         cache_aware=self.cfg.policy == "cache_aware", prompt_tokens=n,
                         chunk_tokens=layout.chunk_tokens if layout is not None else None,
                         local_prefill_max_tokens=self.cfg.local_prefill_max_tokens)
        dd = legs.decode
        self.metrics.decisions.labels("decode", dd.reason).inc()
        if dd.index is None:
            return self._busy(f"no decode instance can take it ({dd.reason})")
        self._last_decode = dd.index
        decode = self.fleet.decode[dd.index]
        push_id = f"{self.prefix}-{uuid.uuid4().hex}"
        if legs.local:
            self.metrics.decisions.labels("prefill", "skipped_held").inc()
            return Route_(decode, None, push_id, n, dd.hit_chunks, dd.reason)
        pd = legs.prefill
        self.metrics.decisions.labels("prefill", pd.reason).inc()
        if pd.index is None:
            return self._busy(f"no prefill instance can take it ({pd.reason})")
        self._last_prefill = pd.index
        return Route_(decode, self.fleet.prefill[pd.index], push_id, n, dd.hit_chunks, dd.reason)

    def _place_by_cost(self, ids: list[int], layout: KVLayout | None, keys: list, exclude: Instance | None,
                       cached: bool = True) -> Route_ | JSONResponse:
        """Every (prefill, decode) pair's predicted TTFT (costmodel.py), and the least under load caps."""
        est = self.estimates
        n = len(ids)
        keys_by_size: dict[int, list[int]] = {}  # the prompt's chain keys, hashed once for every engine's view
        prompt = costmodel.Prompt(n, layout.chunk_tokens if layout else 1,
                                  layout.page_bytes * layout.push_layers if layout else 0, layout.layers if layout else 1)
        pcs = [costmodel.PrefillCand(p.healthy, p.inflight, est.prefill_speed(p.url), p.pending_tokens,
                                     p.cache.held_tokens(ids, keys_by_size) if p.cache is not None and ids and cached
                                     else 0,
                                     est.prefill_overhead(p.url))
               for p in self.fleet.prefill]
        dcs = [costmodel.DecodeCand(d.healthy and d is not exclude, d.inflight, est.push_speed(d.url),
                                    d.index.held_prefix(keys) if keys else 0, est.decode_wait(d.inflight),
                                    est.local_speed(d.url)) for d in self.fleet.decode]
        # a retry is not refused: its decode leg recomputes now
        slo = self.cfg.ttft_slo_ms / 1000 if self.cfg.ttft_slo_ms and exclude is None else None
        plan = costmodel.choose(prompt, pcs, dcs, self.caps, slo, self._last_prefill)
        self.metrics.decisions.labels("both", plan.reason).inc()
        if plan.reason == "slo":
            self.counters["rejected_slo"] += 1
            self.metrics.slo_rejections.inc()
            retry = max(self.cfg.retry_after_s, int(plan.best.ttft_s - self.cfg.ttft_slo_ms / 1000 + 0.999))
            return error(429, f"the best predicted time to first token, {plan.best.ttft_s * 1000:.0f} ms, is over the "
                         f"SLO of {self.cfg.ttft_slo_ms:.0f} ms; retry later", "overloaded", {"Retry-After": str(retry)})
        if plan.best is None:
            return self._busy(f"no instance can take it ({plan.reason})")
        b = plan.best
        decode = self.fleet.decode[b.decode]
        self._last_decode = b.decode
        prefill = None if b.prefill is None else self.fleet.prefill[b.prefill]
        if prefill is not None:
            self._last_prefill = b.prefill
            self.metrics.decisions.labels("prefill", "no_events" if prefill.cache is None else
                                          "own_cache" if cached else "extra_keys").inc()
        else:
            self.metrics.decisions.labels("prefill", "skipped_held").inc()
        self.metrics.ttft_predicted.observe(b.ttft_s)
        return Route_(decode, prefill, f"{self.prefix}-{uuid.uuid4().hex}", n, dcs[b.decode].held_chunks, "cost", b)

    def _retry_decode(self, exclude: Instance) -> Instance | None:
        """Another decode instance for a request whose decode leg could not be sent, recomputing there: by load
        alone, and no prefill instance needed (``place`` asked for one: with the prefill instances busy, or down,
        a healthy free decode instance went untried and the client had a 502)."""
        cands = [Candidate(d.healthy and d is not exclude, d.inflight) for d in self.fleet.decode]
        dd = choose_decode(cands, 0, self.weights, self._last_decode, cache_aware=False)
        return None if dd.index is None else self.fleet.decode[dd.index]

    def _busy(self, why: str) -> JSONResponse:
        self.counters["rejected_503"] += 1
        return error(503, f"every instance is busy or down: {why}; retry later", "overloaded",
                     {"Retry-After": str(self.cfg.retry_after_s)})

    # ---- legs ----
    @staticmethod
    def _take(inst: Instance, work: float) -> tuple[float, int]:
        """A prefill leg counted on its instance (in flight, and its tokens pending); returns the tokens
        that were pending there before it, and the instance's leg count with it."""
        inst.inflight += 1
        ahead = inst.pending_tokens
        inst.pending_tokens += work
        inst.legs_started += 1
        return ahead, inst.legs_started

    async def _prefill(self, path: str, body: dict, route: Route_, headers: dict,
                       taken: tuple[float, int] | None = None) -> dict | None:
        """The prefill leg, tried again elsewhere as legs.py says. Returns its kv_transfer_params, or None
        (the decode instance recomputes). ``taken``: the first attempt was already counted (``_take``): the leg
        goes at once with its decode leg."""
        tried: list[Instance] = []  # instances, not indices: a reload may change the list between attempts
        inst = route.prefill
        work = route.estimate.computed_tokens if route.estimate else 0
        try:
            leg = legs.prefill_body(body, route.decode.receiver, route.push_id)
        except Exception:
            if taken is not None:  # its first try, counted by _serve: undone
                inst.inflight -= 1
                inst.pending_tokens = max(0.0, inst.pending_tokens - work)
            raise
        for attempt in range(legs.PREFILL_ATTEMPTS):
            tried.append(inst)
            ahead, mark = taken if attempt == 0 and taken is not None else self._take(inst, work)
            t = time.monotonic()
            status, why = None, ""
            try:
                r = await self.client.post(inst.url + path, json=leg, headers=headers)
                status, why = r.status_code, r.text[:300]
                route.prefill_unsure |= legs.gateway_status(status)
                if legs.prefill_outcome(status) is legs.Outcome.PUSHED:
                    self.fleet.ok(inst)
                    route.prefill_served = inst
                    # it ran alone (nothing ahead, nothing started beside it): its time is this leg's compute
                    if work and not ahead and not attempt and inst.legs_started == mark:
                        self.estimates.observe_prefill(inst.url, work, 0.0, time.monotonic() - t)
                    return r.json().get("kv_transfer_params") or None
            except (httpx.HTTPError, ValueError) as e:
                self._unreachable(inst, e)
                status, why = None, f"{type(e).__name__}: {e}"
                route.prefill_unsure |= not isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))
            finally:
                inst.inflight -= 1
                inst.pending_tokens = max(0.0, inst.pending_tokens - work)
            if legs.prefill_outcome(status) is legs.Outcome.REFUSED:
                log.warning("prefill %s refused %s: %s", inst.url, route.push_id, why)
                return None  # the same request would be refused anywhere; the decode leg will say why
            if status is not None:
                self._unreachable(inst, RuntimeError(f"HTTP {status} from the prefill leg"))
            log.warning("prefill %s failed for %s: %s", inst.url, route.push_id, why,
                        extra={"fields": {"event": "prefill_failed", "push_id": route.push_id, "instance": inst.url,
                                          "attempt": attempt}})
            listed = self.fleet.prefill
            nxt = legs.next_prefill(listed, {k for k, p in enumerate(listed) if any(p is t for t in tried)}, attempt)
            if nxt is None:
                break
            if taken is not None and not legs.retry_beside_decode(self.cfg.concurrent_legs,
                                                                  self.fleet.inflight_at(listed[nxt])):
                log.warning("prefill leg of %s not tried again: %s is busy and its decode is waiting already",
                            route.push_id, listed[nxt].url)
                break
            inst = listed[nxt]
            self.counters["prefill_retries"] += 1
        return None

    async def _open_decode(self, decode: Instance, path: str, body: dict, headers: dict,
                           naming: Route_ | None = None) -> httpx.Response:
        """The decode leg, up to its answer's headers. ``naming``: the leg names that route's push, and
        ``decode_took`` is set once its request's headers begin to go out. Before that (a wait for one of the
        router's connections, a connection's set-up) its engine cannot have it. After it the engine may have it:
        bytes in a socket that an engine has not accepted yet are not taken, and a client that hangs up then
        leaves its push unread until ``committed_ttl_ms`` (no way to tell from here)."""
        ext = {}
        if naming is not None:
            async def trace(event: str, info: dict) -> None:
                if event.endswith(".send_request_headers.started"):  # (http11. or http2.)
                    naming.decode_took = True

            ext["trace"] = trace
        req = self.client.build_request("POST", decode.url + path, json=body, headers=headers, extensions=ext)
        return await self.client.send(req, stream=True)

    # ---- HTTP ----
    def _authorized(self, request: Request) -> bool:
        if self.api_key is None:
            return True
        got = request.headers.get("authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode())

    async def _body(self, request: Request) -> dict | JSONResponse:
        cap = self.cfg.max_body_bytes
        n = request.headers.get("content-length")
        if n is not None:
            try:
                if int(n) > cap:
                    return error(413, f"body over {cap} bytes")
            except ValueError:
                return error(400, "bad Content-Length")
        data = bytearray()
        try:  # whole within client_write_timeout_s: a client trickling its body held a connection for good
            async with asyncio.timeout(self.cfg.client_write_timeout_s):
                async for part in request.stream():
                    data += part
                    if len(data) > cap:
                        return error(413, f"body over {cap} bytes")
        except ClientDisconnect:
            return error(400, "client disconnected")
        except TimeoutError:
            return error(408, f"the body did not come whole within {self.cfg.client_write_timeout_s:g} s "
                              "(client_write_timeout_s)")
        try:
            return legs.parse_body(bytes(data))
        except ValueError as e:  # (UnicodeDecodeError too)
            return error(400, f"the body is not a JSON object the engines take: {e}")

    async def completions(self, request: Request) -> Response:
        path = request.url.path
        if not self._authorized(request):
            return error(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")
        body = await self._body(request)
        if isinstance(body, Response):
            self.metrics.requests.labels(path, "bad_request").inc()
            return body
        try:
            check_prompt(path, body)
            if body.get("stream") is not None and not isinstance(body["stream"], bool):
                raise PromptError("'stream' must be a boolean or null")  # (null: vLLM's default, not streamed)
        except PromptError as e:
            self.metrics.requests.labels(path, "bad_request").inc()
            return error(400, str(e))
        body.pop("kv_transfer_params", None)  # push ids are the router's: a client cannot set one
        self.counters["requests"] += 1
        t0 = time.monotonic()
        ids = await self._ids(path, body)
        if isinstance(ids, Response):
            self.metrics.requests.labels(path, "bad_request").inc()
            return ids
        route = self.place(ids, extra=prompt_extras(path, body, self._chunk_tokens()))
        if isinstance(route, Response):
            self.metrics.requests.labels(path, "busy").inc()
            return route
        return await self._unless_gone(request, path, route, self._serve(request, path, body, route, t0))

    async def _unless_gone(self, request: Request, path: str, route: Route_, work) -> Response:
        """``work`` (a request's legs, up to its answer or the start of its stream), cancelled if the client hangs
        up meanwhile, as vLLM's own server does (``with_cancellation``): the legs' connections close, each engine
        aborts its part, and a decode that had not loaded its push withdraws it (integrations/vllm/scheduler.py).
        Without this a client gone from an unstreamed request left both engines computing its answer for nobody.
        A stream, once begun, ends with its client by itself (Starlette cancels its relay)."""
        job = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_hung_up(request))
        try:
            await asyncio.wait((job, gone), return_when=asyncio.FIRST_COMPLETED)
            if not job.done() and (gone.cancelled() or gone.exception() is not None):
                await asyncio.wait((job,))  # (no telling whether the client is there: its answer as before)
        finally:
            gone.cancel()
            if gone.done() and not gone.cancelled():
                gone.exception()  # (retrieved: asyncio would log it as never retrieved)
            if not job.done():
                job.cancel()
        if job.done() and not job.cancelled():
            # (failed, recomputed, or an error of the router's: a 500 below, its push unread all the same)
            self._withdraw_unread(route, "no decode engine took a leg naming it")
            return job.result()
        with contextlib.suppress(asyncio.CancelledError):
            await job  # its cleanup (connections closed, counts undone)
        if (me := asyncio.current_task()) is not None and me.cancelling():
            raise asyncio.CancelledError  # the router itself is stopping, not the client gone
        self.metrics.requests.labels(path, "client_gone").inc()
        log.info("client of %s hung up before its answer: its legs were cancelled", route.push_id,
                 extra={"fields": {"event": "client_gone", "push_id": route.push_id}})
        self._withdraw_unread(route, "its client hung up")
        return error(499, "the client closed the request", "client_closed")

    async def _ids(self, path: str, body: dict) -> list[int] | None | Response:
        """The prompt's token ids, or None (routed by load). An engine's ``/tokenize`` is asked of the healthy
        prefill instances in turn, a second one where the first fails, each within half of TOKENIZE_TIMEOUT_S: the
        first one alone was asked, and one slow or broken there cost every request its wait and its cache-aware
        placement."""
        urls = [""]
        if isinstance(self.tokens, EngineTokens):
            pre = [p for p in self.fleet.prefill if p.healthy] or [d for d in self.fleet.decode if d.healthy]
            if not pre:
                return None
            k = self._tokenize_turn % len(pre)
            self._tokenize_turn += 1
            urls = [i.url for i in pre[k:] + pre[:k]][:2]
        for url in urls:
            try:
                return await asyncio.wait_for(self.tokens.ids(self.client, url, path, body),
                                              TOKENIZE_TIMEOUT_S / len(urls))
            except PromptError as e:
                return error(400, f"the engine cannot tokenize this prompt: {e}")
            except Exception as e:  # noqa: BLE001 - an engine's or a chat template's failure: the engine answers it
                log.warning("tokenizing for chunk keys%s failed (%s: %s)%s", f" at {url}" if url else "",
                            type(e).__name__, e, "; routing by load only" if url == urls[-1] else "; asking another")
        return None

    async def _serve(self, request: Request, path: str, body: dict, route: Route_, t0: float) -> Response:
        headers = legs.upstream_headers(request.headers, own_key=self.api_key is not None)
        together = route.prefill is not None and legs.at_once(self.cfg.concurrent_legs, self.fleet.inflight_at(route.prefill))
        mode = "conditional" if route.prefill is None else ("concurrent" if together else "sequential")
        self.metrics.prompt_chunks.inc(-(-route.prompt_tokens // self._chunk_tokens()) if route.prompt_tokens else 0)
        self.metrics.hit_chunks.inc(route.hit_chunks)
        log.info("route %s", route.push_id, extra={"fields": {
            "event": "route", "push_id": route.push_id, "decode": route.decode.url,
            "prefill": route.prefill.url if route.prefill else None, "mode": mode, "reason": route.reason,
            "prompt_tokens": route.prompt_tokens, "hit_chunks": route.hit_chunks,
            "decode_inflight": route.decode.inflight}})
        prefill_task = None
        # the decode instance counted from placement, not from its leg: one after the other, requests placed while
        # this one's prefill leg runs must see it there, or the load caps let a burst pile onto one instance
        route.decode.inflight += 1
        relaying = False
        try:
            if route.prefill is None:
                self.counters["conditional"] += 1
                params = kv_params.for_decode(route.push_id, claim=True)
            elif together:
                # counted now, not when the task first runs: a request placed before then must see this one's load
                taken = self._take(route.prefill, route.estimate.computed_tokens if route.estimate else 0)
                prefill_task = asyncio.create_task(self._prefill(path, body, route, headers, taken))
                prefill_task.add_done_callback(lambda t, route=route: self._withdraw_if_unpushed(t, route))
                params = kv_params.for_decode(route.push_id)
            else:
                params = await self._prefill(path, body, route, headers)
                route.unpushed = params is None and not route.prefill_unsure
            if route.prefill is not None and prefill_task is None:
                self.counters["pushed" if params else "recomputed"] += 1
            relaying = True  # the relay's count from here: it undoes it on every way out
            return await self._relay(path, body, route, params, headers, prefill_task, mode, t0)
        except asyncio.CancelledError:  # its client gone (_unless_gone): a prefill leg beside it goes too
            if prefill_task is not None:
                prefill_task.cancel()
            raise
        finally:
            if not relaying:
                route.decode.inflight -= 1

    def _chunk_tokens(self) -> int:
        lay = self._layout()
        return lay.chunk_tokens if lay else 1

    async def _relay(self, path: str, body: dict, route: Route_, params: dict | None, headers: dict,
                     prefill_task: asyncio.Task | None, mode: str, t0: float) -> Response:
        decode = route.decode  # (counted in flight by _serve)
        resp = None
        try:
            try:
                resp = await self._open_decode(decode, path, legs.decode_body(body, params), headers,
                                               route if params is not None else None)
            except httpx.HTTPError as e:  # it could not be reached: another one, recomputing
                if isinstance(e, (httpx.ReadTimeout, httpx.PoolTimeout)):  # its engine has the leg and is still at it
                    raise  # (a 504), or the router's connections are all in use (a 503): no second generation
                    # elsewhere, nor a failure counted against a healthy instance
                route.decode_took = False  # (it failed the leg: it will not read the push)
                self._settle_later(prefill_task, route)  # nor will anyone else: a leg beside it is cancelled now
                prefill_task = None
                self._unreachable(decode, e)
                other = self._retry_decode(decode)
                if other is None:
                    raise
                self.counters["decode_retries"] += 1
                log.warning("decode %s failed for %s (%s); retrying on %s with recompute", decode.url, route.push_id,
                            e, other.url)
                decode.inflight -= 1
                decode = other
                decode.inflight += 1
                resp = await self._open_decode(decode, path, legs.decode_body(body, None), headers)
        except asyncio.CancelledError:  # its client gone (_unless_gone; _serve cancels a prefill leg beside it)
            decode.inflight -= 1
            self._settle_later(prefill_task, route)
            raise
        except httpx.HTTPError as e:
            decode.inflight -= 1
            self._settle_later(prefill_task, route)
            if isinstance(e, httpx.PoolTimeout):
                self.metrics.requests.labels(path, "busy").inc()
                return error(503, f"the router's {self.cfg.max_upstream_connections} upstream connections are all "
                             f"in use (max_upstream_connections)", "busy", {"Retry-After": "1"})
            self.metrics.requests.labels(path, "upstream_error").inc()
            status = 504 if isinstance(e, httpx.TimeoutException) else 502
            return error(status, f"decode instance {decode.url}: {type(e).__name__}: {e}", "upstream_error",
                         {"X-Pdpush-Upstream": decode.url})
        except Exception:  # a bug of the router's: its counts are undone all the same (the client gets a 500)
            decode.inflight -= 1
            self._settle_later(prefill_task, route)
            raise
        if resp.status_code != 200:
            # its engine refused or failed the leg: it will not read the push (a gateway's 502 or 504: it may)
            route.decode_took &= legs.gateway_status(resp.status_code)
            try:
                data = await resp.aread()
            except httpx.HTTPError as e:  # its error answer broke off too
                self._unreachable(decode, e)
                self.metrics.requests.labels(path, "upstream_error").inc()
                return error(504 if isinstance(e, httpx.TimeoutException) else 502,
                             f"decode instance {decode.url} broke off its {resp.status_code} answer: "
                             f"{type(e).__name__}: {e}", "upstream_error", {"X-Pdpush-Upstream": decode.url})
            finally:
                await resp.aclose()
                decode.inflight -= 1
                self._settle_later(prefill_task, route)
            self.metrics.requests.labels(path, f"upstream_{resp.status_code}").inc()
            passed = {"X-Pdpush-Upstream": decode.url}
            if legs.sendable(after := resp.headers.get("retry-after")) and len(after) <= 64:  # (an engine's 503 says when to come back)
                passed["Retry-After"] = after
            return Response(data, resp.status_code, media_type=resp.headers.get("content-type", "application/json"),
                            headers=passed)
        self.fleet.ok(decode)
        extra = {"X-Pdpush-Route": mode, "X-Pdpush-Decode": decode.url, "X-Pdpush-Push-Id": route.push_id}
        served = route.prefill_served or route.prefill  # a concurrent leg may not have answered yet: the planned one
        if served is not None:
            extra["X-Pdpush-Prefill"] = served.url
            if route.estimate is not None and served is route.prefill:  # cost_model: its cache's predicted share
                extra["X-Pdpush-Prefill-Cached"] = str(route.prompt_tokens - route.estimate.computed_tokens)
        if body.get("stream"):
            counted = []  # the stream's outcome, once counted: else, at its end, its client went (or the router)

            async def relay():
                first = True
                try:
                    async for part in resp.aiter_raw():
                        if first:
                            first = False
                            self._observed(route, t0, True)
                        yield part
                    counted.append("ok")
                    self.metrics.requests.labels(path, "ok").inc()
                except httpx.HTTPError as e:  # the decode instance died mid-stream
                    counted.append("upstream_error")
                    self._unreachable(decode, e)
                    self.metrics.requests.labels(path, "upstream_error").inc()
                    log.error("decode %s broke the stream of %s: %s", decode.url, route.push_id, e)
                    # the client's connection is broken off too, not ended as if the answer were whole: a client
                    # (or a proxy) then sees the stream cut (an incomplete chunked body), not a shorter answer
                    raise StreamCut(f"decode {decode.url} broke the stream of {route.push_id}") from e
                finally:
                    if not counted:  # (a stream whose client hung up was counted nowhere)
                        self.metrics.requests.labels(path, "client_gone").inc()
                    await resp.aclose()
                    decode.inflight -= 1
                    self.metrics.seconds.labels(mode).observe(time.monotonic() - t0)
                    self._settle_later(prefill_task, route)

            def stalled() -> None:
                counted.append("client_stalled")
                self.metrics.requests.labels(path, "client_stalled").inc()
                log.warning("client of %s took no part of its stream for %.1f s: cut off", route.push_id,
                            self.cfg.client_write_timeout_s,
                            extra={"fields": {"event": "client_stalled", "push_id": route.push_id}})

            return _Relayed(relay(), self.cfg.client_write_timeout_s, stalled, status_code=200,
                            media_type=resp.headers.get("content-type", "text/event-stream"), headers=extra)
        try:
            data = await resp.aread()
        except httpx.HTTPError as e:
            self._unreachable(decode, e)
            self.metrics.requests.labels(path, "upstream_error").inc()
            return error(504 if isinstance(e, httpx.TimeoutException) else 502,
                         f"decode instance {decode.url} broke off its answer: {type(e).__name__}: {e}",
                         "upstream_error", {"X-Pdpush-Upstream": decode.url})
        finally:
            await resp.aclose()
            decode.inflight -= 1
            self._settle_later(prefill_task, route)  # the answer does not wait for the prefill's reply
        self._observed(route, t0, False)
        self.metrics.requests.labels(path, "ok").inc()
        self.metrics.seconds.labels(mode).observe(time.monotonic() - t0)
        return Response(data, 200, media_type="application/json", headers=extra)

    def _observed(self, route: Route_, t0: float, stream: bool) -> None:
        """A cost-model decision's predicted and observed time to first token, logged and exported."""
        if route.estimate is None:
            return
        seen = time.monotonic() - t0
        self.metrics.ttft_observed.labels("yes" if stream else "no").observe(seen)
        e = route.estimate
        log.info("ttft %s", route.push_id, extra={"fields": {
            "event": "ttft", "push_id": route.push_id, "predicted_ms": round(e.ttft_s * 1000, 1),
            "observed_ms": round(seen * 1000, 1), "stream": stream, "queue_ms": round(e.queue_s * 1000, 1),
            "compute_ms": round(e.compute_s * 1000, 1), "transfer_ms": round(e.transfer_s * 1000, 1),
            "wait_ms": round(e.wait_s * 1000, 1), "computed_tokens": e.computed_tokens,
            "pushed_chunks": e.pushed_chunks}})

    def _withdraw_if_unpushed(self, task: asyncio.Task, route: Route_) -> None:
        """A prefill leg sent beside its decode leg that surely pushed nothing (refused, or failed wherever it was
        tried, each try with an error status or a refused connection): the decode waits for that push up to its
        connector's ``push_wait_s``. Its receiver is told that the push will not come (``protocol.Withdraw``),
        so the decode recomputes at once. A try that may have reached its engine unanswered leaves it waiting."""
        if task.cancelled() or (task.exception() is None and task.result()):
            return  # (cancelled: its client gone, nobody to read its push, or the router stops)
        if route.prefill_unsure or task.exception() is not None:  # (an error of the router's after a try was sent)
            log.warning("prefill leg of %s pushed nothing that the router knows of; not withdrawn (a try may have "
                        "reached its engine): the decode waits for it up to its push_wait_s", route.push_id)
            return

        def done(sent: bool) -> None:
            self.counters["withdraw_sent" if sent else "withdraw_unsent"] += 1
            self.metrics.withdrawals.labels("sent" if sent else "unsent").inc()
            log.warning("prefill leg of %s pushed nothing: %s", route.push_id,
                        f"telling its receiver {route.decode.receiver} that it will not come" if sent else
                        f"its receiver {route.decode.receiver} cannot be told (the decode waits out its "
                        "push_wait_s)",
                        extra={"fields": {"event": "withdraw", "push_id": route.push_id,
                                          "receiver": route.decode.receiver, "sent": sent}})

        self.watches.withdraw(route.decode, route.push_id, "the prefill leg failed", done)

    def _withdraw_unread(self, route: Route_, why: str) -> None:
        """A request ended (answered, or its client hung up) with no decode engine that took a leg naming its push
        and did not fail it: nobody will read that push, and no decode will withdraw it. So when the client hung up
        before that leg went out (one leg after the other, in the prefill leg; a wait for a connection to the
        decode), when the decode engine refused or failed the leg (an error status, a broken connection), or when
        the leg recomputed on another decode instance. Its receiver is told so (``protocol.Unread``): a push already
        begun there that nobody has open is dropped once committed, one that begins later (a retried prefill leg, a
        leg still running beside its decode) is refused. Without it the push, once its prefill engine had handed it
        over, stayed committed and unread for ``committed_ttl_ms``. A decode leg its engine took is that engine's
        to abort, and its connector withdraws a push it had not loaded."""
        if not legs.unread_owed(route.prefill is not None, route.decode_took, route.unpushed):
            return  # no push (conditional: the decode's own claim goes with its request), its decode's, or none made

        def done(sent: bool) -> None:
            self.counters["unread_sent" if sent else "unread_unsent"] += 1
            self.metrics.withdrawals.labels("unread_sent" if sent else "unread_unsent").inc()

        self.watches.withdraw(route.decode, route.push_id, why, done, unread=True)

    def _withdrawn(self, d: Instance, push_id: str) -> None:
        """The receiver acknowledged a withdrawal (its ``Ok``)."""
        self.counters["withdrawn"] += 1
        self.metrics.withdrawals.labels("acknowledged").inc()

    def _settle_later(self, task: asyncio.Task | None, route: Route_) -> None:
        """Count how a concurrent prefill leg went when it ends; the decode's answer, which has ended, does not wait
        for it. The task is kept referenced until then, and cancelled if it is still running
        ``prefill_leg_linger_s`` later: nothing needs its push any more (config.py says why). At once where no
        decode engine took the decode leg (it failed, or recomputed on another instance): nobody reads the push."""
        if task is None:
            return
        self._legs.add(task)
        timer, cancelled = None, []
        linger = legs.linger_s(self.cfg.prefill_leg_linger_s, route.decode_took)
        why = (f"unanswered {linger:.1f} s after its decode's answer ended (its prefill instance is likely queued)"
               if route.decode_took else "no decode engine took its decode leg")
        if not task.done():
            timer = asyncio.get_running_loop().call_later(linger, self._cancel_leg, task, cancelled)

        def done(t: asyncio.Task) -> None:
            self._legs.discard(t)
            if timer is not None:
                timer.cancel()
            if t.cancelled():  # neither pushed nor known to be recomputed
                if cancelled:  # by _cancel_leg, not the router stopping
                    self.counters["prefill_cancelled"] += 1
                    self.metrics.prefill_cancelled.inc()
                    log.warning("prefill leg of %s cancelled: %s", route.push_id, why,
                                extra={"fields": {"event": "prefill_cancelled", "push_id": route.push_id}})
                return
            params = None
            if t.exception() is not None:
                log.error("prefill leg of %s: %r", route.push_id, t.exception())
            else:
                params = t.result()
            self.counters["pushed" if params else "recomputed"] += 1

        task.add_done_callback(done)

    @staticmethod
    def _cancel_leg(task: asyncio.Task, cancelled: list) -> None:
        if not task.done() and not task.cancelling():  # (cancelling: its client gone, _serve; not counted)
            cancelled.append(True)
            task.cancel()  # its connection closes; the engine aborts the request

    def _fit(self, inst: Instance) -> dict:
        """What the cost model takes a prefill instance's speed to be, and from how many legs of its own."""
        e = self.estimates
        return {"tokens_per_s": round(e.prefill_speed(inst.url), 1), "overhead_ms": round(e.prefill_overhead(inst.url)
                * 1000, 2), "legs_measured": e.samples.get(inst.url, 0)}

    async def health(self, request: Request) -> Response:
        self._reap()  # a retired instance whose last leg just ended is not shown draining until the next check
        f = self.fleet
        inst = {i.name: {"healthy": i.healthy, "inflight": i.inflight, "failures": i.failures,
                         "ejections": i.ejections, "last_error": i.last_error,
                         **({"index_synced": i.index.synced, "index_chunks": len(i.index.keys),
                             "index_seq": i.index.seq, "index_resyncs": i.index.resyncs} if i.role == "decode" else {}),
                         **({"cache_view": i.cache.stats()} if i.cache is not None else {}),
                         **({"prefill_fit": self._fit(i)} if i.role == "prefill" else {})}
                for i in f.all()}
        ok = any(d.healthy for d in f.decode)
        draining = {i.name: {"inflight": i.inflight} for i in f.retired}  # dropped by a reload, requests in flight
        return JSONResponse({"status": "ok" if ok else "unavailable", "instances": inst, "draining": draining,
                             "last_reload": self.last_reload, **self.counters}, 200 if ok else 503)

    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return error(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")
        for d in [d for d in self.fleet.decode if d.healthy]:
            try:
                r = await self.client.get(d.url + "/v1/models", timeout=10, headers=legs.upstream_headers(
                    request.headers, own_key=self.api_key is not None))
            except httpx.HTTPError as e:
                self._unreachable(d, e)
                continue
            return Response(r.content, r.status_code, media_type="application/json")
        return error(503, "no decode instance is up", "overloaded", {"Retry-After": str(self.cfg.retry_after_s)})

    async def metrics_endpoint(self, request: Request) -> Response:
        m = self.metrics
        for i in self.fleet.retired + self.fleet.all():  # a listed instance's series win over a dropped one's
            m.healthy.labels(i.url).set(1 if i.healthy else 0)
            m.inflight.labels(i.url).set(i.inflight)
        for p in self.fleet.prefill:
            if p.cache is not None:
                m.prefill_view_blocks.labels(p.url).set(len(p.cache.by_hash))
                for why, n in p.cache.resyncs.items():
                    m.prefill_view_resyncs.labels(p.url, why).set(n)
        for d in self.fleet.decode:
            m.index_chunks.labels(d.receiver).set(len(d.index.keys))
            m.index_synced.labels(d.receiver).set(1 if d.index.synced else 0)
        return Response(generate_latest(m.registry), media_type="text/plain; version=0.0.4")

    def app(self) -> Starlette:
        async def not_found(request: Request, exc) -> Response:
            return error(404, f"no route {request.method} {request.url.path}")

        async def not_allowed(request: Request, exc) -> Response:
            return error(405, f"{request.method} not allowed on {request.url.path}")

        async def crashed(request: Request, exc) -> Response:
            if not isinstance(exc, StreamCut):  # (logged by the relay: its decode's failure, not the router's)
                log.exception("internal error on %s", request.url.path, exc_info=exc)
            return error(500, "internal error in the router", "internal_error")

        @contextlib.asynccontextmanager
        async def lifespan(app):
            await self.start()
            try:
                yield
            finally:
                await self.stop()

        routes = [Route(p, self.completions, methods=["POST"]) for p in COMPLETIONS]
        routes += [Route("/v1/models", self.models, methods=["GET"]), Route("/health", self.health, methods=["GET"]),
                   Route("/metrics", self.metrics_endpoint, methods=["GET"])]
        return Starlette(routes=routes, lifespan=lifespan,
                         exception_handlers={404: not_found, 405: not_allowed, 500: crashed})


def serve(cfg: RouterConfig) -> None:
    """Run until SIGTERM/SIGINT (uvicorn's handlers: stop accepting, finish in-flight requests)."""
    import socket

    import uvicorn

    from pdpush.daemon import die_with_launcher, raise_open_files, write_ready_file

    orphaned = {"count": 0}
    die_with_launcher(orphaned)  # started by pdpush.launch: SIGTERM when the launcher dies
    if orphaned["count"]:  # it died before we could tie ourselves to it: nobody would stop us
        log.warning("the process that started the router (PDPUSH_LAUNCHER_PID) died before it was up: not serving")
        return
    open_files = raise_open_files(log)  # 1,024 connections to the engines, and the clients' beside them
    router = Router(cfg)
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(router.app(), log_level=cfg.log_level, access_log=False,
                                           timeout_graceful_shutdown=30, h11_max_incomplete_event_size=64 << 10))
    logging.getLogger("uvicorn.error").addFilter(_not_a_cut)  # (after its Config, which sets its loggers up)

    async def main() -> None:
        # SIGHUP: the config file read again (its instance lists); set before anything is served
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, router.sighup)

        async def ready() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            info = {"role": "router", "url": f"http://{cfg.host}:{port}", "pid": os.getpid(),
                    "push_id_prefix": router.prefix, "open_files_limit": open_files}
            log.info("ready: %s", json.dumps(info))
            if cfg.ready_file:
                write_ready_file(cfg.ready_file, info)

        t = asyncio.create_task(ready())
        await server.serve(sockets=[sock])
        t.cancel()

    asyncio.run(main())
