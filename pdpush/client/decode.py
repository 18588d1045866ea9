"""The decode engine's client (``DecodeClient``) to its receiver, and one request's view of what landed
(``DecodeRequest``): open or claim, wait for each layer, read its KV straight from the pool, release.

Imports numpy; torch only when a torch tensor is asked for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pdpush import kvcodec
from pdpush.client.connection import DEFAULT_WAIT, Attachments, Connection, WaitPolicy, raise_error, untakeable
from pdpush.errors import (
    BrokenResourceError,
    IncompatiblePeer,
    PdpushError,
    ProtocolError,
    RemoteProtocolError,
    TransportTimeout,
    UnexpectedMessage,
)
from pdpush.layout import KVLayout, PoolGeometry, chunk_keys, rank_heads, runs
from pdpush.plan import RequestPlan, tokens_of
from pdpush.protocol import (
    MAX_CHUNKS,
    Claim,
    ClaimOk,
    Committed,
    Error,
    LayerAvailable,
    Msg,
    Open,
    OpenOk,
    Query,
    QueryReply,
    Release,
)

log = logging.getLogger(__name__)


class DecodeRequest:
    """An opened request: zero-copy views of each layer as it lands in the pool."""

    def __init__(self, client: DecodeClient, ok: OpenOk, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.client = client
        self.req_id = ok.req_id
        self.layout = ok.layout.kv_layout
        self.geometry = PoolGeometry(self.layout, ok.pool_pages, ok.pool_shards, ok.state_slots)
        self.heads = rank_heads(self.layout.kv_heads, tp_size, tp_rank)  # the KV heads [h0, h1) this rank reads
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.state_slot = ok.state_slot
        self.pages = list(ok.pages)  # one per item (plan.py): group 0's chunks, then each window group's
        _check_open(ok)
        self.tokens = tokens_of(self.layout, ok.chunks or len(self.pages), ok.last_chunk_tokens)
        self.last_key = ok.last_key  # the request's last chunk key: it covers all its tokens (b"": not said)
        new = set(ok.new_idx)
        self.plan = RequestPlan(self.layout, self.tokens, [i for i in range(len(self.pages)) if i not in new])
        if self.plan.items != len(self.pages):
            raise ProtocolError(f"open of {ok.req_id!r}: {len(self.pages)} pages for {self.plan.items} items")
        # each group's pages, in chunk order (``layer_chunks``)
        self._group_pages = [[self.pages[i] for i in range(gp.first_item, gp.first_item + len(gp.chunks))]
                             for gp in self.plan.groups]
        self.ready: set[int] = set(ok.layers_ready)
        self._committed = ok.committed
        if ok.committed:  # a committed request has every layer (its state layers too)
            self.ready.update(range(self.layout.push_layers))
        self.pool_pages = ok.pool_pages
        self._shmid = ok.shmid
        self._pool = client._segments.hold(ok.shmid, self.geometry.total_bytes)
        self.page_runs = runs(self._group_pages[0]) if self._group_pages else []
        # readiness words (layout.py): a layer has landed when every new page of its group holds our lease id
        self.lease_id = ok.lease_id
        self._new_pages = [np.array([self.pages[i] for i in range(gp.first_item, gp.first_item + len(gp.chunks))
                                     if i in new], dtype=np.int64) for gp in self.plan.groups]
        kv, words = self.layout.kv_bytes(ok.pool_pages), self.layout.layers * ok.pool_pages * 8
        try:
            self._words = (self._pool.array[kv:kv + words].view(np.uint64).reshape(self.layout.layers, ok.pool_pages)
                           if ok.ready_in_pool and ok.lease_id else None)
        except ValueError:
            client._segments.drop(ok.shmid)
            raise
        # completion on the data path: every layer's readiness words in means committed (the receiver commits
        # such a request when it next looks, and never ends it any other way once its words are in)
        self.words = ok.completion == "words" and self._words is not None
        self._checks = self._word_checks() if self._words is not None else []
        self._released = False
        self.broken: str | None = None
        self._life = client._conn.life  # the receiver's lifeline: closed, it died

    def _pump(self, deadline: float) -> None:
        try:
            msg = self.client._conn.recv_for(self.req_id, deadline, life=self._life)
        except BrokenResourceError as e:
            self.broken = str(e)
            raise BrokenResourceError(f"request {self.req_id!r}: {e}; its pages are not valid") from None
        self._apply(msg)

    def _check_receiver(self) -> None:
        if self.broken is None and self._life is not None and not self._life.alive():
            self.broken = "receiver died (its lifeline closed)"
        if self.broken is not None:
            raise BrokenResourceError(f"request {self.req_id!r}: {self.broken}; its pages are not valid")

    def _word_checks(self) -> list[tuple]:
        """How ``_landed`` reads each layer's words: where its group's new pages are one run, a view of their
        words and the bytes they hold once landed (one compare, no gather: a decode engine asks this of every
        layer); else the pages, gathered."""
        by_group = []
        for pages in self._new_pages:
            one_run = len(pages) and int(pages[-1]) - int(pages[0]) == len(pages) - 1 and (np.diff(pages) == 1).all()
            want = np.full(len(pages), self.lease_id, np.uint64).tobytes() if one_run else None
            by_group.append((int(pages[0]) if one_run else 0, pages, want))
        out = []
        for layer in range(self.layout.layers):
            first, pages, want = by_group[self.layout.group_of(layer).index]
            out.append((self._words[layer, first:first + len(pages)], want) if want is not None else (pages, None))
        return out

    def _landed(self, layer: int) -> bool:
        """The layer's readiness words say it is in the pool (no message needed)."""
        if not 0 <= layer < len(self._checks):
            return False  # no words (a state layer, or a pool without them)
        words, want = self._checks[layer]
        if want is None:
            return bool((self._words[layer, words] == self.lease_id).all())
        return words.tobytes() == want

    def landed(self, layer: int) -> bool:
        """Whether layer ``layer`` is in the pool now (never waits)."""
        if layer in self.ready:
            return True
        if self._landed(layer):
            self.ready.add(layer)
            return True
        return False

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Wait until layer ``layer`` is in the pool: its readiness words in the pool say so, or the
        receiver's LayerAvailable does, as the client's ``WaitPolicy`` says (a decode engine usually
        waits for layers already on the way)."""
        if not 0 <= layer < self.layout.push_layers:
            raise ValueError(f"layer {layer} out of range")
        box = self.client._conn.mail.get(self.req_id)
        while box:
            self._apply(box.pop(0))
        if layer in self.ready:
            return
        t = time.monotonic()
        deadline = t + (timeout_s if timeout_s is not None else self.client.timeout_s)
        pol = self.client.wait
        spin_until, nap_until = t + pol.spin_s, t + pol.nap_window_s
        reading_until = max(spin_until, nap_until)  # re-reading the words: a look at the mail never waits till then
        while layer not in self.ready:
            if self._landed(layer):
                self.ready.add(layer)
                return
            now = time.monotonic()
            if spin_until <= now < nap_until:
                time.sleep(pol.nap_s)
            try:  # an error or a notice from the receiver, if one came
                self._pump(now if now < reading_until else min(deadline, now + pol.slice_s))
            except TransportTimeout:
                if time.monotonic() >= deadline and not self._landed(layer):
                    raise TransportTimeout(f"layer {layer} of {self.req_id!r} did not arrive in time") from None

    def _apply(self, msg: Msg) -> None:
        if isinstance(msg, LayerAvailable):
            self.ready.update(msg.layers)
        elif isinstance(msg, Committed):
            self._committed = True
            self.ready.update(range(self.layout.push_layers))
        else:
            if isinstance(msg, Error):
                self.broken = f"{msg.code.value}: {msg.message}"
            raise_error(msg)

    def poll_committed(self) -> bool:
        """Whether the push has committed (every layer landed), never waiting; raises its typed error if it
        failed, or if the receiver died."""
        box = self.client._conn.mail.get(self.req_id)
        while box:
            self._apply(box.pop(0))
        while not self.committed:
            try:
                self._pump(time.monotonic())
            except TransportTimeout:
                break
        self._check_receiver()
        return self.committed

    def wait_committed(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.client.timeout_s)
        while not self.committed:
            self._check_receiver()  # failed (its Error read), or the receiver died
            try:  # a words request: look at its words again every 0.5 ms (its Committed comes at a later tick)
                self._pump(min(deadline, time.monotonic() + 0.0005) if self.words else deadline)
            except TransportTimeout:
                if time.monotonic() >= deadline:
                    raise
        self._check_receiver()

    @property
    def committed(self) -> bool:
        """Whether the push has committed, as heard so far: its Committed (or the OpenOk), or, for a request
        that completes on the data path, every layer's readiness words in, unless the receiver has said it
        failed (never waits: what has arrived for the request is read first, so a failure the receiver decided
        before the last words landed, its Error already sent, wins)."""
        if not self._committed and self.broken is None and self.words and \
                all(self.landed(la) for la in range(self.layout.push_layers)):
            try:
                self.client._conn.drain()
                box = self.client._conn.mail.get(self.req_id)
                while box:
                    self._apply(box.pop(0))
            except PdpushError:
                return False  # it failed (``broken`` says how)
            self._committed = self.broken is None
        return self._committed and self.broken is None

    def _ready_layer(self, layer: int, wait: bool, timeout_s: float | None) -> None:
        if wait:
            self.wait_layer(layer, timeout_s)
        self._check_receiver()  # never hand out pages of a dead receiver as if they were valid
        if layer not in self.ready:
            raise UnexpectedMessage(f"layer {layer} of {self.req_id!r} is not ready")

    def layer_shards(self, layer: int, wait: bool = True,
                     timeout_s: float | None = None) -> list[tuple[int, np.ndarray]]:
        """This rank's heads of layer ``layer`` in the whole pool, zero-copy: one ``(first head, view)``
        per pool shard they span (usually one), the view row bytes ``[pool_pages, heads, C, T, D * B]``;
        the first head counts from this rank's first. This request's chunks are at ``self.pages``. Only
        where shards are whole heads (``PoolGeometry.heads_aligned``); ``read_layer`` reads any pool."""
        self._ready_layer(layer, wait, timeout_s)
        g, lay = self.geometry, self.layout
        per = lay.kv_heads // g.shards
        out, at = [], 0
        for s, j, k in g.heads(*self.heads):
            off = g.offset(layer, s, 0)
            shard = self._pool.array[off:off + g.pages * g.shard_bytes].reshape(
                g.pages, per, lay.components, lay.chunk_tokens, lay.row_bytes)
            out.append((at, shard[:, j:j + k]))
            at += k
        return out

    def layer_runs(self, layer: int, wait: bool = True, timeout_s: float | None = None) -> list[np.ndarray]:
        """Zero-copy views of this rank's heads, one per run of consecutive pages: row bytes
        ``[n, heads, C, T, D * B]``. Where the heads span several pool shards, use ``read_layer``."""
        parts = self.layer_shards(layer, wait, timeout_s)
        if len(parts) != 1:
            raise ValueError(f"heads {self.heads} span {len(parts)} pool shards: use read_layer()")
        view = parts[0][1]
        return [view[p:p + n] for _, p, n in runs(self.layer_pages(layer))]

    def layer_chunks(self, layer: int) -> range:
        """The chunks this request holds of ``layer``: every chunk, or for a sliding-window layer those of
        its window (``KVLayout.group_chunks``); ``layer_pages`` are their pages."""
        return self.plan.of(layer).chunks

    def layer_pages(self, layer: int) -> list[int]:
        return self._group_pages[self.layout.group_of(layer).index]

    def group_pages(self, group: int) -> list[int]:
        """Layer group ``group``'s pages, one per chunk of ``plan.groups[group].chunks``."""
        return self._group_pages[group]

    def pool_bytes(self, layer: int, wait: bool = True, timeout_s: float | None = None) -> np.ndarray:
        """The whole pool region's bytes, once ``layer`` is ready (for ``kvcodec.read_rows``/``read_pages``)."""
        self._ready_layer(layer, wait, timeout_s)
        return self._pool.array[:self.geometry.region_bytes]

    def read_layer(self, layer: int, wait: bool = True, timeout_s: float | None = None) -> np.ndarray:
        """A copy of this rank's heads of the layer's pages (``layer_chunks``): row bytes
        ``[chunks, heads, C, T, D * B]``."""
        pool = self.pool_bytes(layer, wait, timeout_s)
        return kvcodec.read_pages(pool, self.geometry, layer, np.asarray(self.layer_pages(layer), dtype=np.int64),
                                  self.heads)

    def _layer_tokens(self, layer: int) -> int:
        return self.tokens - self.layer_chunks(layer).start * self.layout.chunk_tokens

    def kv_bytes(self, layer: int, wait: bool = True, timeout_s: float | None = None) -> tuple[np.ndarray, ...]:
        """This rank's heads of one layer as bytes, one ``[tokens, heads, D * B]`` per component (K and V,
        or the MLA latent; a copy). A sliding-window layer's start at its first chunk's first token."""
        rows = kvcodec.page_rows_to_tokens(self.read_layer(layer, wait, timeout_s), self._layer_tokens(layer))
        return tuple(rows[:, :, c] for c in range(self.layout.components))

    def layer_kv(self, layer: int, wait: bool = True, timeout_s: float | None = None):
        """This rank's heads of one layer as torch tensors, one ``[tokens, heads, D]`` per component (as
        ``kv_bytes``)."""
        import torch

        rows = torch.from_numpy(np.ascontiguousarray(
            kvcodec.page_rows_to_tokens(self.read_layer(layer, wait, timeout_s), self._layer_tokens(layer))))
        x = kvcodec.elements(rows, self.layout.dtype)
        return tuple(x[:, :, c].clone() for c in range(self.layout.components))

    def state_bytes(self, wait: bool = True, timeout_s: float | None = None) -> np.ndarray:
        """This rank's units of the request's state, zero-copy: ``[state_layers, units / tp, unit bytes]``
        (state layer ``s`` lands as the layer ``layout.layers + s``; this waits for them all)."""
        lay = self.layout
        if self.state_slot < 0:
            raise ValueError(f"request {self.req_id!r} carries no state")
        for s in range(lay.state_layers):
            self._ready_layer(lay.layers + s, wait, timeout_s)
        lay.check_state_tp(self.tp_size)
        off = self.geometry.state_at(self.state_slot)
        k = lay.state_units // self.tp_size
        return self._pool.array[off:off + lay.state_slot_bytes].reshape(
            lay.state_layers, lay.state_units, lay.state_unit_bytes)[:, self.tp_rank * k:(self.tp_rank + 1) * k]

    def release(self, wait: bool = True) -> None:
        """Give the request's pages back to the receiver (views handed out must not be used after this).
        ``wait=False``: the Release goes without waiting for the receiver's answer (an engine's step must not
        wait on a receiver that is alive but not reading; one that has died is seen by the connection)."""
        if not self._released:
            self._released = True
            self.client._segments.drop(self._shmid)
            if self.broken is not None:  # failed: the receiver keeps its pages out of use until this Release (or
                # this connection's end), since they may have been read; a receiver that died took them with it
                conn = self.client._conn
                conn.end(self.req_id)
                if self._life is None or (self._life is conn.life and self._life.alive()):
                    conn.post(Release(req_id=self.req_id, answer=False, lease_id=self.lease_id))
                return
            try:
                if wait:
                    self.client._conn.call(Release(req_id=self.req_id, lease_id=self.lease_id), self.req_id,
                                           self.client.timeout_s)
                else:
                    self.client._conn.post(Release(req_id=self.req_id, answer=False, lease_id=self.lease_id))
            finally:
                self.client._conn.end(self.req_id)

    def __enter__(self) -> DecodeRequest:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _check_open(ok: OpenOk) -> None:
    """The pages, items and state slot an OpenOk names lie within the pool it describes, and its chunks within a
    request's (a plan is made of them, an entry each): a reader's views and copies are indexed by them."""
    pages_out = bool(ok.pages) and max(ok.pages) >= ok.pool_pages
    items_out = bool(ok.new_idx) and max(ok.new_idx) >= len(ok.pages)
    slot_out = ok.state_slot >= 0 and ok.state_slot >= ok.state_slots
    if pages_out or items_out or slot_out or ok.chunks > MAX_CHUNKS:
        raise RemoteProtocolError(f"open of {ok.req_id!r}: the receiver's answer names pages, items, chunks or a "
                                  f"state slot outside its pool of {ok.pool_pages} pages, {ok.state_slots} slots",
                                  req_id=ok.req_id)


class PendingOpen:
    """An Open sent and not answered yet (``DecodeClient.open_nowait``)."""

    def __init__(self, client: DecodeClient, req_id: str, tp_rank: int, tp_size: int, deadline: float) -> None:
        self.client, self.req_id, self.tp_rank, self.tp_size = client, req_id, tp_rank, tp_size
        self.deadline = deadline  # from the send, as a blocking open's
        # the receiver it went to: a restarted one's lifeline replaces it on the connection, and an answer from
        # the dead one must not hand out views of its pool
        self.life = client._conn.life
        self._abandoned = False

    def wait(self) -> DecodeRequest:
        """The opened request, or the receiver's typed error; TransportTimeout past the deadline (the open is then
        given up: its answer, or the receiver's word that it waited too long, never answers a later open)."""
        try:
            reply = self.client._conn.reply(self.req_id, self.deadline, check=False, life=self.life)
        except TransportTimeout:
            self.abandon()
            raise
        return self._request(reply)

    def poll(self) -> DecodeRequest | None:
        """The opened request if its answer has come, else None (never waits); its typed error, or
        TransportTimeout once past the deadline."""
        try:
            reply = self.client._conn.reply(self.req_id, time.monotonic(), check=False, life=self.life)
        except TransportTimeout:  # nothing yet (a typed error reply is raised below, never taken for this)
            if time.monotonic() >= self.deadline:
                self.abandon()  # (as ``wait``'s)
                raise TransportTimeout(f"open of {self.req_id!r}: no answer from the receiver in time") from None
            return None
        return self._request(reply)

    def abandon(self, lease_id: int = 0) -> None:
        """Give the open up unanswered (a failed load): its answer is dropped when it comes, and the receiver
        releases what it opened (Release after Open, in order on one connection; an error reply is dropped).
        ``lease_id``: its OpenOk's, where that came and could not be taken (else the receiver takes the newest open
        of the id on this connection)."""
        if self._abandoned:
            return
        self._abandoned = True
        conn = self.client._conn
        if not lease_id:  # its answer may have come, not taken: the Release names that open (a push that then failed
            try:  # keeps an open named by none until its lease_ms)
                conn.drain()
            except PdpushError as e:  # (a frame that could not be read: the connection's next reader says so too)
                log.warning("pdpush: reading the daemon's answers while giving up an open of %r: %s", self.req_id, e)
            lease_id = next((m.lease_id for m in conn.mail.get(self.req_id, ()) if isinstance(m, OpenOk)), 0)
        conn.end(self.req_id)
        # without waiting (an engine's step gives loads up), and unanswered: a late answer would answer a later open
        conn.post(Release(req_id=self.req_id, answer=False, lease_id=lease_id))  # (no receiver: its lifeline ends
        # what this opened)

    def _request(self, reply: Msg) -> DecodeRequest:
        try:
            raise_error(reply)
        except IncompatiblePeer:  # (an answer of another local protocol, say): the receiver releases what it opened
            self.abandon()
            raise
        except PdpushError:  # refused (unknown, released, aborted): nothing more will come for it
            self.client._conn.end(self.req_id)
            raise
        if not isinstance(reply, OpenOk):
            self.abandon()
            raise RemoteProtocolError(f"unexpected {reply.type} in reply to open", req_id=self.req_id)
        if self.life is not None and not self.life.alive():
            self.client._conn.end(self.req_id)  # (what it opened went with it)
            raise BrokenResourceError(f"open of {self.req_id!r}: the receiver that answered it died")
        try:
            req = DecodeRequest(self.client, reply, self.tp_rank, self.tp_size)
        except (ValueError, IndexError, PdpushError) as e:  # an answer this engine cannot take: released
            self.abandon(reply.lease_id)
            raise untakeable(e, "open", self.req_id) from None
        req._life = self.life
        return req


class DecodeClient:
    """Reads pushed KV from the local receiver's pool, zero-copy."""

    def __init__(self, receiver_socket: str | Path, *, timeout_s: float = 30.0, pin_cuda: bool = False,
                 wait: WaitPolicy = DEFAULT_WAIT) -> None:
        self.timeout_s = timeout_s
        self.wait = wait
        self._conn = Connection(receiver_socket)
        self._segments = Attachments(readonly=True)  # the pool: read here, never written (its words commit)
        if pin_cuda:  # the pool is page-locked in this process, for asynchronous host-to-device copies
            self._segments.pin_all()

    def wait_mapped(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the daemon's segments this client holds to be mapped into this process (a
        thread does it from their first use on, ``Attachments.populated``); whether they are."""
        return self._segments.populated(timeout_s)

    def open(self, req_id: str, timeout_s: float | None = None, *, tp_rank: int = 0,
             tp_size: int = 1) -> DecodeRequest:
        """Open a request (waits until its allocation exists on the receiver). A decode rank of
        ``tp_size`` reads its own heads (``layout.rank_heads``: replicated where TP exceeds the KV heads)."""
        return self.open_nowait(req_id, timeout_s, tp_rank=tp_rank, tp_size=tp_size).wait()

    def open_nowait(self, req_id: str, timeout_s: float | None = None, *, tp_rank: int = 0,
                    tp_size: int = 1, exists: bool = False) -> PendingOpen:
        """``open`` without waiting for the receiver's answer: send it before the forward and take the answer
        at the first layer (``PendingOpen.wait``), or once it has come (``poll``), so that its round trip
        overlaps the compute. ``timeout_s`` counts from now. ``exists``: the request must be on the receiver
        already (its push began), else ``UnknownRequest`` at once, rather than a wait for its push."""
        self._conn.begin(req_id)
        self._conn.lifeline()  # the receiver releases this engine's opens if it dies, and we see the receiver die
        t = timeout_s if timeout_s is not None else self.timeout_s
        pending = PendingOpen(self, req_id, tp_rank, tp_size, time.monotonic() + t)
        self._conn.send(Open(req_id=req_id, tp_size=tp_size, exists=exists), t)
        pending.life = self._conn.life  # the one it went out on (the send connects anew where the daemon died)
        return pending

    def held_prefix(self, token_ids, layout: KVLayout) -> int:
        """How many leading chunks of this prompt the receiver holds complete."""
        return self.query(token_ids, layout).held_prefix

    def query(self, token_ids, layout: KVLayout, req_id: str | None = None,
              timeout_s: float | None = None, extra: Sequence[bytes] = ()) -> QueryReply:
        """Ask the chunk index about a prompt: chunks held complete, and (with ``req_id``) how many
        of its leading chunks that pushed request, possibly still arriving, carries. ``extra``: the prompt's
        chunks' extra keys (``layout.chunk_keys``), as its push named them."""
        msg = Query(chunk_keys=chunk_keys([int(t) for t in token_ids], layout, extra), req_id=req_id)
        reply = self._conn.call(msg, None, timeout_s if timeout_s is not None else self.timeout_s)
        if not isinstance(reply, QueryReply):
            raise ProtocolError(f"unexpected {reply.type} in reply to query")
        return reply

    def claim(self, req_id: str, token_ids, layout: KVLayout, lease_ms: int = 30_000,
              timeout_s: float | None = None, extra: Sequence[bytes] = ()) -> int:
        """Make ``req_id`` a request of the prompt's leading chunks the receiver already holds, with
        no push: ``open`` then reads it like a pushed one. Returns the chunks claimed (0: none held,
        nothing made). They stay pinned until released, or ``lease_ms`` if never opened. ``extra``: as ``query``'s."""
        ids = [int(t) for t in token_ids]
        keys = chunk_keys(ids, layout, extra)
        last = len(ids) - (len(keys) - 1) * layout.chunk_tokens
        reply = self._conn.call(Claim(req_id=req_id, chunk_keys=keys, last_chunk_tokens=last, lease_ms=lease_ms),
                                req_id, timeout_s if timeout_s is not None else self.timeout_s)
        if not isinstance(reply, ClaimOk):
            raise ProtocolError(f"unexpected {reply.type} in reply to claim")
        return reply.chunks

    def flush(self) -> None:
        """Write what was sent without waiting (``release(wait=False)``) and the socket could not take then: call it
        now and then (an engine's step), or those wait for this connection's next message."""
        self._conn.flush()

    def close(self) -> None:
        self._segments.close()
        self._conn.close()
