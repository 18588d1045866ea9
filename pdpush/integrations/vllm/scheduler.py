"""The connector's scheduler side: which requests to push (prefill), how many prompt tokens a push
will provide (decode), and the metadata that tells the workers. One record per request."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdpush import kv_params, protocol
from pdpush.errors import (
    Aborted,
    BrokenResourceError,
    DuplicateRequest,
    PdpushError,
    RequestTooLarge,
    ShuttingDown,
    TransportError,
    UnknownRequest,
)
from pdpush.extra_keys import beyond_tokens, chunk_extras
from pdpush.integrations.vllm.asker import Asker, Lost
from pdpush.integrations.vllm.metadata import LoadSpec, PdpushConnectorMetadata, PushSpec
from pdpush.integrations.vllm.settings import ConnectorSettings, Endpoints, ReceiverLink
from pdpush.integrations.vllm.stats import PushFailure, Recompute, SchedulerStats
from pdpush.kv_params import KvParams
from pdpush.layout import KVLayout, chunk_keys
from pdpush.protocol import Query, QueryReply, Withdraw

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("pdpush.vllm")

# A decode request whose push has not begun yet is asked for again on the next scheduler step; when
# that step has nothing else to run, vLLM's engine loop would spin on it. It naps this long instead:
# an idle engine loses nothing, a busy one never naps.
IDLE_NAP_S = 0.01
MAX_QUERIES = 64  # questions to the receiver outstanding at once (asker.py)
MAX_WITHDRAWALS = 4096  # withdrawals waiting to be sent (the oldest dropped beyond: kept until their TTL)
# an answer older than this (asked when the request arrived, looked at later: the engine was full) is
# asked again rather than acted on
ANSWER_FRESH_S = 0.25


def loads_async(mode: str, committed: bool, running: int) -> bool:
    """Whether a pushed request loads outside the batch (``load_mode``, settings.py): always or never as
    set, else only while its push is still arriving and ``running`` other requests would wait on it."""
    if mode != "auto":
        return mode == "async"
    return not committed and running > 0

# the receiver's own refusals of a Claim, where it made none; any other failure (a timeout, a broken connection, an
# answer that did not decode) may have lost the answer to a claim it made, which is then withdrawn at the request's end
CLAIM_REFUSED = (Aborted, DuplicateRequest, RequestTooLarge, ShuttingDown, UnknownRequest)


@dataclass
class _Req:
    """Everything the scheduler side knows of one request."""

    # prefill: a request marked for push, until its prompt is computed and handed to the workers
    push_id: str = ""
    receiver: str = ""
    token_ids: list[int] = field(default_factory=list)
    extra: list[bytes] = field(default_factory=list)  # its chunks' extra keys (extra_keys.py), prefill and decode
    block_ids: list[list[int]] = field(default_factory=list)  # one list per KV cache group
    pushed: bool = False
    # decode: the load planned for this step (push id, start, end), and how long we have asked for it
    plan: tuple[str, int, int] | None = None
    prompt_tokens: int = 0
    planned_once: bool = False  # planned before (then preempted): its push was released, recompute
    gave_up: bool = False  # its push did not come within push_wait_s: withdrawn, recomputed whenever asked again
    push_gone: bool = False  # the receiver said its push ended (failed, or used): nothing to withdraw
    first_ask: float | None = None
    next_ask: float = 0.0
    asking: bool = False  # a question about its push is out (asker.py); its answer is read at a later call
    answer: QueryReply | None = None  # the receiver's answer, not acted on yet
    answer_at: float = 0.0
    lost: str = ""  # the receiver missed the deadline of the question about it
    query: Query | None = None  # the question about its push (its prompt's chunk keys: hashed once)
    claimed: int | None = None  # chunks claimed from the receiver's index (conditional disaggregation)
    claim_unsure: bool = False  # the claim failed but not by the receiver's refusal: it may have made it all the same
    asynchronous: bool = False  # the load planned is asynchronous (loads_async)
    prefix_key: bytes = b""  # planned from the prefill's answer, not asked: the key the push's open must show
    async_blocks: list[list[int]] | None = None  # an asynchronous load's blocks (update_state_after_alloc)
    beyond: str = ""  # what its KV depends on that chunk keys cannot cover (extra_keys.py): neither pushed nor loaded


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, endpoints: Endpoints, layout: KVLayout, engine_tag: str,
                 producer: bool, consumer: bool, kv_groups: int = 1, mm_hashed: bool = True) -> None:
        self.settings, self.endpoints, self.layout = settings, endpoints, layout
        self.mm_hashed = mm_hashed  # the engine names multimodal items by their content's hash (extra_keys.py)
        self.engine_tag = engine_tag
        self.producer, self.consumer = producer, consumer
        self.reqs: dict[str, _Req] = {}
        self.stats = SchedulerStats()  # what vLLM reports (stats.py)
        self.receiver = ReceiverLink(endpoints, settings.timeout_s)
        # whether a push has begun arriving, asked without waiting (asker.py): the scheduler loop never
        # waits on the receiver while other requests run
        self.asker = Asker(endpoints.receiver_socket or "", timeout_s=settings.query_timeout_s,
                           retry_s=settings.receiver_retry_s, max_inflight=MAX_QUERIES) if consumer else None
        self._nap_left = 0.0  # of this step's nap (IDLE_NAP_S where the last step ran nothing): see _nap
        self._napped = 0.0  # of the current _answer: seconds waited on an idle step
        self._live: set[str] = set()  # requests scheduled at least once and not finished: those a load could hold up
        self._awaiting: set[str] = set()  # asynchronous loads handed to the workers, not yet scheduled
        # pushes to withdraw (push id, why), sent as the asker has room: many requests can end in one step
        self._to_withdraw: deque[tuple[str, str]] = deque(maxlen=MAX_WITHDRAWALS)
        # a model of several KV cache groups (sliding windows, state) loads asynchronously: vLLM can take a
        # failed load only as a failed request then, never as failed blocks (it recomputes it from token 0)
        self.load_async = bool(layout.windows or layout.state_layers) or kv_groups > 1
        if consumer:
            self.receiver.get()  # a wrong path fails at start-up, with its name

    def on_new_request(self, request: Request) -> None:
        """A model with recurrent state: a prefill for a remote decode stops one token short of the prompt,
        so that the state it pushes is the state after N - 1 tokens, which the decode's step on the last
        prompt token continues (as vLLM's NixlConnector does: ``_truncate_request_for_prefill``)."""
        params = request.kv_transfer_params
        kp = KvParams.parse(params)
        if beyond_tokens(request, self.mm_hashed):  # neither pushed nor loaded (get_num_new_matched_tokens says so, and counts it)
            return
        if self.consumer and kp.pdpush_req_id and not kp.pdpush_claim and not kp.from_prefill(self.layout):
            self._ask_early(request, str(kp.pdpush_req_id))  # (the prefill's answer says what it pushed: no question)
        if not (self.producer and self.layout.state_layers and kp.do_remote_decode):
            return
        if params.get("_pdpush_truncated") or request.num_prompt_tokens < 2 or request.prompt_token_ids is None:
            return
        if request.get_skip_reading_prefix_cache() or not self.endpoints.receiver_allowed(
                str(kp.pdpush_receiver or self.settings.receiver or "")):
            return  # the decode recomputes the whole prompt (prompt logprobs), or this push will be refused
        del request.prompt_token_ids[-1:]
        del request._all_token_ids[-1:]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_pdpush_truncated"] = True
        self.stats.push_truncated += 1

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = KvParams.parse(request.kv_transfer_params)
        rid = request.request_id
        r = self.reqs.get(rid)
        if (self.producer and params.do_remote_decode or self.consumer and params.pdpush_req_id) and (
                beyond := beyond_tokens(request, self.mm_hashed)):
            return self._beyond(rid, beyond, params)
        if self.producer and params.do_remote_decode and (r is None or not r.push_id):
            receiver = str(params.pdpush_receiver or self.settings.receiver or "")
            if self.endpoints.receiver_allowed(receiver):
                r = self.reqs.setdefault(rid, _Req())
                r.push_id, r.receiver, r.token_ids = (params.push_id_or(f"{self.engine_tag}-{rid}"), receiver,
                                                      list(request.prompt_token_ids or []))
                r.extra = chunk_extras(request, self.layout.chunk_tokens)
            else:
                self.stats.refuse_push()
                log.warning("pdpush: request %s names receiver %r, which is not in allowed_receivers; "
                            "not pushing it", rid, receiver)
        push_id = params.pdpush_req_id
        if not (self.consumer and push_id) or (r is not None and (r.planned_once or r.gave_up)):
            return 0, False  # planned before (then preempted: its push was released), or its push given up
        prompt = list(request.prompt_token_ids or [])
        want = len(prompt) - 1  # the last prompt token is computed here, giving the first sampled token
        if want <= num_computed_tokens:
            return 0, False
        r = self.reqs.setdefault(rid, _Req())
        r.prompt_tokens = len(prompt)
        r.extra = r.extra or chunk_extras(request, self.layout.chunk_tokens)
        if params.pdpush_claim:
            return self._claim(request, r, str(push_id), prompt, want, num_computed_tokens)
        if (pushed := params.pushed_prefix(prompt, self.layout, r.extra)) is not None:
            return self._from_answer(rid, r, str(push_id), pushed, want, num_computed_tokens)
        reply = self._answer(rid, r, prompt[:want] if self.layout.state_layers else prompt, str(push_id))
        if reply is None or isinstance(reply, int):
            return reply, False
        now = time.monotonic()
        if reply.request_chunks == 0 and reply.request_gone:  # it failed or was already used: recompute now
            r.push_gone = True
            self.stats.recompute(Recompute.PUSH_ENDED)
            log.warning("pdpush: push %s for %s has ended on the receiver; recomputing", push_id, rid)
            return 0, False
        if reply.request_chunks == 0:  # not on the receiver (yet): ask again in a later step, for a while
            if r.first_ask is None:
                r.first_ask = now
            if now - r.first_ask < self.settings.push_wait_s:
                r.next_ask = now + 0.01
                self._nap()
                return None, False
            r.first_ask, r.gave_up = None, True  # (vLLM asks again while it finds no blocks: counted once)
            self.stats.recompute(Recompute.PUSH_TIMEOUT)
            told = self._withdraw(push_id, now)
            log.warning("pdpush: push %s for %s never reached the receiver; recomputing%s", push_id, rid,
                        " (told the receiver to refuse it if it comes)" if told else
                        " (the receiver is told to refuse it as soon as it can be)")
            return 0, False
        r.first_ask = None
        r.prefix_key = b""
        return self._plan(rid, r, str(push_id), min(want, reply.request_chunks * self.layout.chunk_tokens), want,
                          num_computed_tokens, reply.request_committed)

    def _beyond(self, rid: str, beyond: str, params: KvParams) -> tuple[int, bool]:
        """A request whose KV depends on what chunk keys cannot cover (extra_keys.py): not pushed (a prefill), not loaded (a
        decode: it computes the prompt itself, and the push it names is withdrawn when it ends). Counted once."""
        r = self.reqs.setdefault(rid, _Req())
        if not r.beyond:
            r.beyond = beyond
            if self.producer and params.do_remote_decode:
                self.stats.refuse_push(PushFailure.BEYOND_TOKENS)
            if self.consumer and params.pdpush_req_id:
                self.stats.recompute(Recompute.BEYOND_TOKENS)
            log.warning("pdpush: request %s: its KV depends on %s besides its token ids, which pdpush's chunk keys "
                        "do not cover: neither pushed nor loaded (its decode computes the prompt)", rid, beyond)
        return 0, False

    def _from_answer(self, rid: str, r: _Req, push_id: str, pushed: tuple[int, bytes], want: int,
                     computed: int) -> tuple[int, bool]:
        """A decode leg that carries the prefill's answer (``KvParams.pushed_prefix``): its load planned from it, no
        question to the receiver (one round trip less before the first token). The prefill answers once it handed
        the push to its worker, so the push is normally on the receiver; where its Begin failed (the open is
        refused at once: ``Open.exists``) or it is of another prompt (the open's ``last_key``), the load fails and
        vLLM recomputes. Whether it has committed is not known: ``auto`` loads it outside the batch while others
        run, so that none waits on it."""
        if self.asker is not None and self.asker.down(time.monotonic()):  # it did not answer lately: no load
            self.stats.recompute(Recompute.RECEIVER_DOWN)
            return 0, False
        tokens, key = pushed
        if self.layout.state_layers and tokens != want:  # its state is after its last token: that must be N - 1
            self.stats.recompute(Recompute.PARTIAL)
            return 0, False
        if r.prefix_key != key:  # (counted once: vLLM may ask again while it finds no blocks)
            r.prefix_key = key
            self.stats.match_params += 1
        return self._plan(rid, r, push_id, min(want, tokens), want, computed, False)

    def _plan(self, rid: str, r: _Req, push_id: str, end: int, want: int, computed: int,
              committed: bool) -> tuple[int, bool]:
        """A load of tokens ``[computed, end)`` of push ``push_id`` (``end``: what the push holds of the ``want``
        tokens), or none: a model with state loads all of them or nothing."""
        if end <= computed or (self.layout.state_layers and end < want):
            if end < want and self.layout.state_layers:  # its state is after N - 1 tokens: all of them, or none
                self.stats.recompute(Recompute.PARTIAL)
            return 0, False
        r.plan = (push_id, computed, end)
        r.asynchronous = self.load_async or loads_async(self.settings.load_mode, committed,
                                                        len(self._live) - (rid in self._live))
        self.stats.match_tokens += end - computed
        if r.asynchronous:
            self.stats.match_async += 1
        else:
            self.stats.match_layerwise += 1
        return end - computed, r.asynchronous

    def _ask_early(self, request: Request, push_id: str) -> None:
        """A decode request arrives: ask about its push now, so that the answer is in by the time the
        scheduler first looks at it (``get_num_new_matched_tokens``), rather than one step later."""
        prompt = list(request.prompt_token_ids or [])
        if len(prompt) < 2 or self.asker.down(time.monotonic()):
            return
        r = self.reqs.setdefault(request.request_id, _Req())
        if r.asking or r.answer is not None:
            return
        t0 = time.perf_counter()
        try:
            r.extra = r.extra or chunk_extras(request, self.layout.chunk_tokens)
            r.query = Query(chunk_keys=chunk_keys(prompt[:-1] if self.layout.state_layers else prompt, self.layout,
                                                  r.extra), req_id=push_id)
            r.asking = self.asker.ask(r.query, request.request_id, time.monotonic())
            self.stats.match_queries += r.asking
        except Lost as e:
            self._lost(e)
        finally:
            self.stats.match_query_us += int((time.perf_counter() - t0) * 1e6)

    def _answer(self, rid: str, r: _Req, prompt: list[int], push_id: str) -> QueryReply | int | None:
        """The receiver's answer about ``push_id`` (a model with state: its push is of the prompt's first
        N - 1 tokens, on_new_request), or what to tell vLLM without one: None (ask again at a later step)
        or 0 (recompute). The question goes out without waiting; its answer is read at a later call, or,
        on a step with nothing else to run, waited for up to ``IDLE_NAP_S`` (nothing else would run)."""
        t0, self._napped = time.perf_counter(), 0.0
        try:
            return self._answer_now(rid, r, prompt, push_id)
        finally:  # the time it held the scheduler's thread (an idle step's wait held up nothing)
            self.stats.match_query_us += int((time.perf_counter() - t0 - self._napped) * 1e6)

    def _answer_now(self, rid: str, r: _Req, prompt: list[int], push_id: str) -> QueryReply | int | None:
        now = time.monotonic()
        self._read_answers(now)
        if r.answer is not None and now - r.answer_at > ANSWER_FRESH_S:
            r.answer = None
        if r.answer is None and not r.asking and not r.lost:
            if now < r.next_ask:  # asked very recently; the scheduler loop spins faster than pushes arrive
                self._napped += self._nap()
                return None
            if self.asker.down(now):  # it did not answer recently: do not ask now
                self.stats.recompute(Recompute.RECEIVER_DOWN)
                return 0
            r.query = r.query or Query(chunk_keys=chunk_keys(prompt, self.layout, r.extra), req_id=push_id)
            try:
                r.asking = self.asker.ask(r.query, rid, now)
            except Lost as e:
                r.lost = str(e)
                self._lost(e)
            if r.asking:
                self.stats.match_queries += 1
        if r.asking and self._nap_left > 0:  # nothing else runs this step: wait for the answer instead of spinning
            t = time.perf_counter()
            self.asker.wait(self._nap_left)
            waited = time.perf_counter() - t
            self._napped += waited
            self._nap_left = max(0.0, self._nap_left - waited)  # (the rest is napped if the push is not there)
            self._read_answers(time.monotonic())
        if r.lost:
            why, r.lost = r.lost, ""
            log.error("pdpush: receiver query for %s failed; recomputing it, and not asking for %.0f s: %s", rid,
                      self.settings.receiver_retry_s, why)
            self.stats.recompute(Recompute.RECEIVER_ERROR)
            return 0
        reply, r.answer = r.answer, None
        return reply

    def _nap(self) -> float:
        """Sleep what is left of this step's nap: on a step with nothing else to run, a request still waiting for
        its push would have vLLM's loop spin a core that the prefill may need. ``IDLE_NAP_S`` a step in all, however
        many requests wait (each used to nap it: 20 of them made a step 200 ms). Returns the seconds slept."""
        left, self._nap_left = self._nap_left, 0.0
        if left > 0:
            time.sleep(left)
        return left

    def _withdraw_unread(self, request: Request, r: _Req | None) -> None:
        """A decode request that named a push ends without its load ever handed to a worker: aborted (its client
        hung up, maybe while it queued here), or its prompt found in this engine's own cache. Nobody will read that
        push: withdrawn, so that it leaves the receiver's pool now (or is refused if it begins later), rather than
        holding its pages unread for ``committed_ttl_ms``. A push that was loaded is released by its reader, and one
        given up is withdrawn already. A claim made and never loaded is withdrawn too: its held chunks are unpinned
        now rather than at the end of its lease (one whose answer was lost too, as the receiver may have made it); a
        claim never made (or of nothing held) pinned nothing."""
        kp = KvParams.parse(request.kv_transfer_params)
        if not kp.pdpush_req_id or (r is not None and (r.planned_once or r.gave_up or r.push_gone)):
            return
        if kp.pdpush_claim and not (r is not None and (r.claimed or r.claim_unsure)):
            return
        if r is not None and r.beyond:  # not loaded by choice (``_beyond``, counted and logged there): withdrawn
            self._withdraw(str(kp.pdpush_req_id), time.monotonic(), f"its KV depends on {r.beyond} too")
            return
        self.stats.push_unread += 1
        log.info("pdpush: request %s ended without loading %s %s: withdrawing it", request.request_id,
                 "its claim" if kp.pdpush_claim else "push", kp.pdpush_req_id)
        self._withdraw(str(kp.pdpush_req_id), time.monotonic(), "its request ended before loading it")

    def _withdraw(self, push_id: str, now: float, why: str = "") -> bool:
        """Tell the receiver that push ``push_id`` will not be read (``protocol.Withdraw``): one that comes later
        is refused instead of holding pages unread for ``committed_ttl_ms``. Sent without waiting, now or at a
        later step (``_send_withdrawals``); its answer, tagged apart from any request's, is dropped when read.
        False: not sent yet. Beyond ``MAX_WITHDRAWALS`` waiting (its receiver down for long), the oldest is
        dropped, counted (``withdrawals_dropped``) and logged at the 1st, 2nd, 4th, ... : that push waits out its
        TTL."""
        if len(self._to_withdraw) == self._to_withdraw.maxlen:
            self.stats.withdrawals_dropped += 1
            n = self.stats.totals()["withdrawals_dropped"]
            if n & (n - 1) == 0:
                log.warning("pdpush: %d withdrawals waiting for the receiver, which is down: the oldest dropped "
                            "(%d so far; its push is kept until committed_ttl_ms)", len(self._to_withdraw), n)
        self._to_withdraw.append((push_id, why or f"push_wait_s ({self.settings.push_wait_s:g} s)"))
        return self._send_withdrawals(now)

    def _send_withdrawals(self, now: float) -> bool:
        """Send the withdrawals waiting, while at most half the asker's room is taken (the rest is for the questions
        about pushes); read the answers that came first (a decode that loads from the prefill's answers asks
        nothing, and nothing else would read them). True: none is left waiting. One the receiver never gets (it is
        down, or more than ``MAX_WITHDRAWALS`` wait) leaves that push until its TTL, as before."""
        try:
            if self.asker.inflight:
                self._read_answers(now)
            while self._to_withdraw and len(self.asker.inflight) < MAX_QUERIES // 2:
                push_id, why = self._to_withdraw[0]
                if not self.asker.ask(Withdraw(req_id=push_id, reason=why), ("withdraw", push_id), now):
                    break  # the receiver is down: tried again at the next step
                self._to_withdraw.popleft()
        except Lost as e:
            self._lost(e)
        return not self._to_withdraw

    def _read_answers(self, now: float) -> None:
        """File the answers that have arrived with their requests (one that has ended meanwhile: dropped)."""
        try:
            got = self.asker.answers(now)
        except Lost as e:
            self._lost(e)
            return
        for rid, msg in got:
            r = self.reqs.get(rid)
            if r is None or not r.asking:
                continue
            r.asking = False
            if isinstance(msg, QueryReply):
                r.answer, r.answer_at = msg, now
            else:  # an error reply
                r.lost = f"{getattr(msg, 'code', msg.type)}: {getattr(msg, 'message', '')}"

    def _lost(self, e: Lost) -> None:
        """The receiver missed a deadline: every request asked about recomputes, and none is asked
        about for ``receiver_retry_s`` (the asker has a fresh socket for later)."""
        for rid in e.tags:
            r = self.reqs.get(rid)
            if r is not None:
                r.asking, r.lost = False, str(e)

    def _claim(self, request: Request, r: _Req, push_id: str, prompt: list[int], want: int,
               computed: int) -> tuple[int, bool]:
        """Conditional disaggregation: no push; load the prompt's chunks this node's receiver already
        holds (a request made of them under ``push_id``), and compute the rest here."""
        if r.claimed is None:
            if self.asker is not None and self.asker.down(time.monotonic()):  # (a claim is a blocking round trip)
                self.stats.recompute(Recompute.RECEIVER_DOWN)
                r.claimed = 0
                return 0, False
            self.stats.match_queries += 1
            try:
                r.claimed = self.receiver.get().claim(push_id, prompt, self.layout, extra=r.extra,
                                                      timeout_s=self.settings.query_timeout_s)
            except PdpushError as e:
                log.error("pdpush: claim of held chunks for %s failed; computing the prompt here: %s",
                          request.request_id, e)
                if not isinstance(e, CLAIM_REFUSED):  # (a refusal was answered: the connection is sound; made again,
                    self.receiver.reset()  # it would count as another for the receiver's caps on claims)
                r.claimed, r.claim_unsure = 0, not isinstance(e, CLAIM_REFUSED)
                if (isinstance(e, (TransportError, BrokenResourceError)) or protocol.local_mismatch(e)) \
                        and self.asker is not None:
                    # no answer, or no receiver: none asked for receiver_retry_s (a claim stalls a step)
                    self.asker.down_until = time.monotonic() + self.settings.receiver_retry_s
        end = min(want, r.claimed * self.layout.chunk_tokens)
        if end <= computed:
            if not r.claimed:
                self.stats.recompute(Recompute.NOTHING_HELD)
            return 0, False
        r.plan = (push_id, computed, end)
        r.asynchronous = self.load_async  # claimed chunks are all there: nothing to wait for
        self.stats.match_tokens += end - computed
        self.stats.claimed_tokens += end - computed
        return end - computed, r.asynchronous

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        r = self.reqs.get(request.request_id)
        self._nap_left = 0.0  # a request admitted: this step runs something, so the ones after it never nap
        if not (r is not None and r.plan is not None and r.asynchronous and num_external_tokens):
            self._live.add(request.request_id)  # scheduled in this very step: a later request sees it running
        if r is None or r.plan is None:
            return
        if num_external_tokens == 0:
            r.plan = None
        elif r.plan[2] - r.plan[1] != num_external_tokens:  # vLLM counts them from the start it gave us: a trim
            r.plan = (r.plan[0], r.plan[1], r.plan[1] + min(num_external_tokens, r.plan[2] - r.plan[1]))  # cuts the end
        if r.asynchronous and r.plan is not None:  # not scheduled this step: it waits for the load
            r.async_blocks = [list(b) for b in blocks.get_block_ids()]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PdpushConnectorMetadata:
        meta = PdpushConnectorMetadata()
        so = scheduler_output
        if self._to_withdraw or (self.asker is not None and self.asker.inflight):
            self._send_withdrawals(time.monotonic())  # (and the answers that came: the room they take is freed)
        idle = so.total_num_scheduled_tokens == 0
        self._nap_left = IDLE_NAP_S if idle else 0.0  # the next step's, spent by the first request waiting
        self._live.difference_update(getattr(so, "preempted_req_ids", None) or ())  # (not running till scheduled)
        self._live.update(so.num_scheduled_tokens)
        for rid, r in self.reqs.items():  # asynchronous loads allocated this step (update_state_after_alloc)
            if r.async_blocks is not None and r.plan is not None:
                meta.loads.append(LoadSpec(rid, r.plan[0], r.async_blocks, r.plan[1], r.plan[2], r.prompt_tokens,
                                           asynchronous=True, claim=r.claimed is not None, prefix_key=r.prefix_key))
                r.plan, r.planned_once, r.async_blocks = None, True, None
                self._awaiting.add(rid)
        self._awaiting.difference_update(so.num_scheduled_tokens)  # loaded (or failed, then recomputed): it runs now
        # (a resumed one too, which vLLM's v1 model runner lists among the cached requests)
        if idle and self._awaiting and not meta.loads:
            # only asynchronous loads wait: each empty step polls them (get_finished), and vLLM's loop would run
            # such steps back to back, a core spinning while the layers arrive; nap, as for a push not yet begun
            time.sleep(IDLE_NAP_S)
            self._nap_left = 0.0  # (napped for the next step already)
            self.stats.load_async_naps += 1
        for new in so.scheduled_new_reqs:
            rid = new.req_id
            r = self.reqs.get(rid)
            if r is None:
                continue
            if r.plan is not None:
                meta.loads.append(LoadSpec(rid, r.plan[0], [list(b) for b in new.block_ids], r.plan[1], r.plan[2],
                                           r.prompt_tokens, claim=r.claimed is not None, prefix_key=r.prefix_key))
                r.plan, r.planned_once = None, True
            if r.push_id and not r.pushed:
                r.block_ids = [list(b) for b in new.block_ids]
                self._maybe_push(meta, rid, r, new.num_computed_tokens + so.num_scheduled_tokens.get(rid, 0))
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            r = self.reqs.get(rid)
            if r is None:
                continue
            if r.plan is not None and rid in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                # a preempted request that first ran with no load (its receiver was down, say) and has one planned
                # now: vLLM's v1 model runner lists it here, with all its blocks, not in scheduled_new_reqs. Its
                # tokens are counted as loaded: without this LoadSpec they would be whatever its blocks held
                meta.loads.append(LoadSpec(rid, r.plan[0], [list(b) for b in cached.new_block_ids[i]], r.plan[1],
                                           r.plan[2], r.prompt_tokens, claim=r.claimed is not None,
                                           prefix_key=r.prefix_key))
                r.plan, r.planned_once = None, True
            if not r.push_id or r.pushed:
                continue
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids and new_blocks is not None:
                r.block_ids = [list(b) for b in new_blocks]  # a resumed request gets all its blocks anew
            elif new_blocks is not None:
                for mine, more in zip(r.block_ids, new_blocks, strict=True):
                    mine.extend(more)
            self._maybe_push(meta, rid, r, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0))
        return meta

    def _maybe_push(self, meta: PdpushConnectorMetadata, rid: str, r: _Req, computed_after: int) -> None:
        if computed_after >= len(r.token_ids):  # the prompt's KV is complete after this step
            meta.pushes.append(PushSpec(rid, r.push_id, r.token_ids, [list(b) for b in r.block_ids], r.receiver,
                                        r.extra))
            r.pushed = True

    def loads_ended(self, req_ids) -> None:
        """Asynchronous loads the workers report ended (vLLM's ``finished_recving``): loaded, or failed and to be
        recomputed. Their requests wait for a step to run, not for a push (no nap for them, and one aborted now
        left no push unread)."""
        self._awaiting.difference_update(req_ids)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if request.request_id in self._awaiting:  # aborted while its asynchronous load waits: the worker gives that
            self._awaiting.discard(request.request_id)  # load up at the next step (``finished_req_ids``), its
            self.stats.push_unread += 1  # pages released, and vLLM frees the blocks then
        self._live.discard(request.request_id)
        r = self.reqs.pop(request.request_id, None)
        if self.consumer:
            self._withdraw_unread(request, r)
        if r is None or not r.pushed:
            return False, None
        # the blocks were copied into staging during the forward: vLLM may free them now
        return False, kv_params.pushed(r.push_id, len(r.token_ids), r.receiver, self.layout.fingerprint())

    def shutdown(self) -> None:
        self.receiver.reset()
        if self.asker is not None:
            self.asker.close()
