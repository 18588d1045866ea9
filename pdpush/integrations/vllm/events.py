"""The decode connector's receiver pool in vLLM's KV events (``take_events``): ``BlockStored`` for the
chunks of the prompts this engine loaded, once the receiver's chunk index holds them, and
``BlockRemoved`` once it no longer does (evicted, or the receiver restarted). vLLM's scheduler merges
them into its own ``KVEventBatch`` (``--kv-events-config``), so a router built on vLLM's events sees
the pdpush pool beside the engine's own blocks.

Each event is one run of whole chunks of one prompt:

* ``medium``: ``"pdpush:" + the receiver's control endpoint`` (what the router and the senders call
  that receiver), asked of the receiver once (``StatusRequest``);
* ``block_size``: the chunk size in tokens (``chunk_tokens``); ``token_ids``: the chunks' tokens;
* ``block_hashes``: pdpush's chunk keys (``layout.chunk_keys``: xxh3-128 chain over the token ids and
  the layout fingerprint), converted as vLLM converts its own (``maybe_convert_block_hash``: the low
  64 bits as an int by default, the 16 bytes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``);
  ``parent_block_hash`` the previous chunk's (None for a prompt's first chunk).

What the pool holds is asked, never assumed. The connector knows the token ids of the prompts it
loads (``track``) but the receiver's index knows what it holds: a ``Query`` of a prompt's chunk keys
on the receiver's local socket answers how many leading chunks are held complete. ``PoolTracker``
(pure logic: no I/O, ``now`` in) decides which prompt to ask about next (each one every ``sweep_s``),
and turns each answer into events: the held leading chunks not yet announced are stored (only while
the chain from the prompt's first chunk is unbroken, so that every parent is known), the first chunk
not held is removed if it was announced, and the chunks past it are asked about again if any of them
was announced. ``PoolEvents`` asks through an ``Asker`` (asker.py: its own DEALER on the receiver's
local socket, every send and receive non-blocking, at most ``MAX_INFLIGHT`` queries outstanding, each
with a deadline, ``query_timeout_s``): a receiver that does not answer in time gets a fresh socket,
after ``receiver_retry_s``, and the scheduler loop never waits on it.

Events are published at the engine's steps (vLLM calls ``take_events`` after each): an idle engine
publishes nothing, so an eviction seen while no request runs is published at the next step. A prompt
whose push never commits is dropped after ``pending_s``. At most ``max_chains`` prompts are followed;
the oldest past that is forgotten and its announced chunks removed (consumers under-count, never
over-count). No ``AllBlocksCleared`` is ever sent: it would clear the engine's own blocks too.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pdpush.integrations.vllm.asker import MAX_FRAME, Asker, Lost
from pdpush.layout import KVLayout, chunk_keys
from pdpush.protocol import Query, QueryReply, StatusReply, StatusRequest

log = logging.getLogger("pdpush.vllm.events")

MEDIUM_PREFIX = "pdpush:"
SWEEP_S = 0.25  # each followed prompt is asked about this often
MAX_INFLIGHT = 8  # queries outstanding on the events socket
MAX_CHAINS = 4096  # prompts followed


@dataclass
class Stored:
    """Chunks ``keys`` (whole, consecutive, of one prompt) are held; ``parent``: the chunk before them."""

    keys: list[bytes]
    parent: bytes | None
    token_ids: list[int]


@dataclass
class Removed:
    keys: list[bytes]


@dataclass
class _Chain:
    keys: list[bytes]  # a prompt's whole chunks
    tokens: list[int]  # their tokens (len(keys) * chunk_tokens)
    created: float
    pending_until: float  # until then, chunks not held yet may still arrive (a push committing)
    next_check: float = 0.0
    cursor: int = 0  # the next query starts at this chunk (past a chunk found missing)
    inflight: bool = False


class PoolTracker:
    """Which chunks have been announced, and what each answer of the receiver changes (pure logic)."""

    def __init__(self, chunk_tokens: int, *, sweep_s: float = SWEEP_S, max_chains: int = MAX_CHAINS) -> None:
        self.T, self.sweep_s, self.max_chains = chunk_tokens, sweep_s, max_chains
        # by the prompt's last chunk key, ordered by next_check (the head is asked about first)
        self.chains: OrderedDict[bytes, _Chain] = OrderedDict()
        self.held: set[bytes] = set()  # announced stored, not since removed
        self.refs: Counter[bytes] = Counter()  # chains holding each key
        self.out: list[Stored | Removed] = []

    def track(self, keys: list[bytes], tokens: list[int], now: float, pending_s: float) -> None:
        """A prompt whose chunks were loaded: ``keys`` its whole chunks' keys, ``tokens`` theirs."""
        if not keys:
            return
        leaf = keys[-1]
        c = self.chains.get(leaf)
        if c is None:
            c = self.chains[leaf] = _Chain(list(keys), list(tokens[:len(keys) * self.T]), now, now + pending_s)
            self.refs.update(c.keys)
            while len(self.chains) > self.max_chains:
                self._drop(min(self.chains, key=lambda k: self.chains[k].created))
        else:
            c.pending_until = max(c.pending_until, now + pending_s)
        c.next_check = now
        self.chains.move_to_end(leaf, last=False)

    def next_query(self, now: float) -> tuple[bytes, int, list[bytes]] | None:
        """(prompt, first chunk, keys to ask about) due now, or None."""
        if not self.chains:
            return None
        leaf, c = next(iter(self.chains.items()))
        if c.inflight or c.next_check > now:
            return None
        c.inflight = True
        c.next_check = now + self.sweep_s
        self.chains.move_to_end(leaf)
        return leaf, c.cursor, c.keys[c.cursor:]

    def on_reply(self, leaf: bytes, start: int, held_prefix: int, now: float) -> None:
        """The receiver holds ``held_prefix`` leading chunks of ``keys[start:]`` of prompt ``leaf``."""
        c = self.chains.get(leaf)
        if c is None:
            return
        c.inflight = False
        keys, end = c.keys, min(len(c.keys), start + held_prefix)
        run: list[int] = []
        for i in range(start, end):
            k = keys[i]
            if k not in self.held and (i == 0 or keys[i - 1] in self.held):  # connected to the prompt's start
                self.held.add(k)
                run.append(i)
                continue
            self._stored(c, run)
            run = []
        self._stored(c, run)
        if end < len(keys):
            if keys[end] in self.held:
                self.held.discard(keys[end])
                self.out.append(Removed([keys[end]]))
            if any(k in self.held for k in keys[end + 1:]):  # announced past the gap: ask about those now
                c.cursor, c.next_check = end + 1, now
                self.chains.move_to_end(leaf, last=False)
                return
        c.cursor = 0
        if end < len(keys) and now >= c.pending_until and not any(k in self.held for k in keys):
            self._drop(leaf)  # its push never committed here, or all of it is gone: nothing left to follow

    def on_lost(self, leaf: bytes) -> None:
        """The query about ``leaf`` got no answer: asked again at its next turn, from its first chunk."""
        c = self.chains.get(leaf)
        if c is not None:
            c.inflight, c.cursor = False, 0

    def take(self) -> list[Stored | Removed]:
        out, self.out = self.out, []
        return out

    def _stored(self, c: _Chain, run: list[int]) -> None:
        if run:
            a, b = run[0], run[-1] + 1
            self.out.append(Stored(c.keys[a:b], c.keys[a - 1] if a else None, c.tokens[a * self.T:b * self.T]))

    def _drop(self, leaf: bytes) -> None:
        c = self.chains.pop(leaf)
        gone = []
        for k in c.keys:
            self.refs[k] -= 1
            if self.refs[k] <= 0:
                del self.refs[k]
                if k in self.held:
                    self.held.discard(k)
                    gone.append(k)
        if gone:
            self.out.append(Removed(gone))


def whole_chunks(token_ids: list[int], layout: KVLayout) -> tuple[list[bytes], list[int]]:
    """A prompt's whole chunks: their keys and tokens (a partial last chunk is not a block)."""
    n = len(token_ids) // layout.chunk_tokens * layout.chunk_tokens
    tokens = [int(t) for t in token_ids[:n]]
    return chunk_keys(tokens, layout), tokens


class PoolEvents:
    """The scheduler side's events of a decode connector: prompts loaded in, vLLM's events out.
    Nothing here blocks: every socket call is non-blocking and every answer has a deadline."""

    def __init__(self, receiver_socket: str, layout: KVLayout, *, timeout_s: float, retry_s: float,
                 pending_s: float, sweep_s: float = SWEEP_S, max_chains: int = MAX_CHAINS,
                 to_hash: Callable[[bytes], object] | None = None) -> None:
        self.asker = Asker(receiver_socket, timeout_s=timeout_s, retry_s=retry_s, max_inflight=MAX_INFLIGHT,
                           max_frame=MAX_FRAME)
        self.endpoint = self.asker.endpoint
        self.layout, self.retry_s, self.pending_s = layout, retry_s, pending_s
        self.tracker = PoolTracker(layout.chunk_tokens, sweep_s=sweep_s, max_chains=max_chains)
        self.to_hash = to_hash or _vllm_hash()
        self.medium: str | None = None
        self.prompts: dict[str, list[int]] = {}  # requests with a load planned: their prompts
        self._status_asked = False
        self.counters = Counter()
        self._answered = True  # since the last loss: the next loss is logged as a warning

    # ---- from the connector's scheduler calls ----
    def planned(self, req_id: str, prompt_token_ids) -> None:
        """``get_num_new_matched_tokens`` planned a load for this request."""
        if prompt_token_ids is not None:
            self.prompts[req_id] = prompt_token_ids

    def loaded(self, req_id: str, now: float) -> None:
        """The request's load went to the workers (``build_connector_meta``): follow its chunks."""
        prompt = self.prompts.pop(req_id, None)
        if prompt is not None:
            keys, tokens = whole_chunks(list(prompt), self.layout)
            self.tracker.track(keys, tokens, now, self.pending_s)

    def finished(self, req_id: str) -> None:
        self.prompts.pop(req_id, None)

    def take_events(self, now: float) -> list:
        """vLLM's ``take_events``: ask and read without waiting, then the events decided so far."""
        try:
            self._io(now)
        except Lost as e:
            self._lost(now, str(e), e.tags)
        if self.medium is None:
            return []  # kept until the receiver has said what it is called
        return [self._vllm(e) for e in self.tracker.take()]

    def close(self) -> None:
        self.asker.close()

    # ---- the questions (asker.py: never waiting) ----
    def _io(self, now: float) -> None:
        if self.asker.down(now):
            return
        if self.medium is None and not self._status_asked:
            self._status_asked = self.asker.ask(StatusRequest(), ("status", b"", 0), now)
        for (kind, leaf, start), msg in self.asker.answers(now):
            self._answered = True
            if kind == "status":
                ep = msg.stats.get("control_endpoint") if isinstance(msg, StatusReply) else None
                self.medium = MEDIUM_PREFIX + str(ep or self.endpoint)
            elif isinstance(msg, QueryReply):
                self.counters["answers"] += 1
                self.tracker.on_reply(leaf, start, msg.held_prefix, now)
            else:  # an error reply: asked again at its next turn
                self.tracker.on_lost(leaf)
        while self.asker.room(now):
            q = self.tracker.next_query(now)
            if q is None:
                break
            leaf, start, keys = q
            if not self.asker.ask(Query(chunk_keys=keys), ("query", leaf, start), now):
                self.tracker.on_lost(leaf)
                break

    def _lost(self, now: float, why: str, tags: list) -> None:
        """The receiver did not answer: the asker has a fresh socket for it (a late answer can never
        answer another query), and asks none before ``retry_s``."""
        self.counters["lost"] += 1
        (log.warning if self._answered else log.debug)(
            "pdpush: KV events: receiver %s: %s; asking again in %.0f s", self.endpoint, why, self.retry_s)
        self._answered = False
        for kind, leaf, _ in tags:
            if kind == "query":
                self.tracker.on_lost(leaf)
            else:
                self._status_asked = False

    # ---- vLLM's classes ----
    def _vllm(self, e: Stored | Removed):
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        h = self.to_hash
        if isinstance(e, Stored):
            self.counters["stored"] += len(e.keys)
            return BlockStored(block_hashes=[h(k) for k in e.keys],
                               parent_block_hash=h(e.parent) if e.parent is not None else None,
                               token_ids=e.token_ids, block_size=self.layout.chunk_tokens, lora_id=None,
                               medium=self.medium, lora_name=None)
        self.counters["removed"] += len(e.keys)
        return BlockRemoved(block_hashes=[h(k) for k in e.keys], medium=self.medium)


def _vllm_hash() -> Callable[[bytes], object]:
    """vLLM's conversion of a block hash for its events (``maybe_convert_block_hash``), or the same rule
    (an int of the low 64 bits, big-endian) where that vLLM has none."""
    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        return maybe_convert_block_hash
    except ImportError:
        return lambda b: int.from_bytes(b, "big") & ((1 << 64) - 1)
