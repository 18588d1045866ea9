"""What a prefill engine's own prefix cache holds, as its vLLM KV events tell it (pure logic: no I/O,
no clock). ``kv_events.py`` moves the frames; this decides.

vLLM (``--kv-events-config``) publishes ``KVEventBatch``es of ``BlockStored`` (block hashes, the parent
block's hash, the blocks' token ids, the block size), ``BlockRemoved`` and ``AllBlocksCleared``, each
batch with a sequence number. Its block hashes depend on the engine's hash algorithm and seed, so the
view does not reproduce them: it keys each block by a chain over **token ids** (xxh3 of the parent's
key and the block's tokens), remembers which engine hash is which key, and a prompt's held prefix is
the leading run of its own chain found (``held_tokens``), whole engine blocks.

Exactness: the view is exact while batches come in order. A gap is the subscriber's to fill from the
engine's replay buffer (``wants_replay``); if the replay does not reach back (a batch still follows a
gap), or the sequence starts again (the engine restarted), the view is cleared and rebuilt from the
events that follow, and the clear is counted (``resyncs``, by reason). vLLM keeps no snapshot, so a view cleared misses the
blocks the engine already held until they are stored again: it under-counts, never over-counts.

Blocks the router cannot match are left out and counted: a LoRA adapter's, a multimodal or salted
prompt's (``extra_keys``), another KV cache group's, another medium's (CPU offload), and blocks whose
parent the view never saw (stored before it started listening).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import xxhash

ROOT = 0  # the chain's key before the first block


def chain(parent: int, tokens: Iterable[int]) -> int:
    """A block's key: its parent's key and its token ids."""
    h = xxhash.xxh3_64(parent.to_bytes(8, "little"))
    h.update(b"".join((int(t) & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little") for t in tokens))
    return h.intdigest()


def prompt_keys(token_ids: list[int], block_size: int) -> list[int]:
    """The chain keys of a prompt's whole blocks."""
    out, key = [], ROOT
    for b in range(len(token_ids) // block_size):
        key = chain(key, token_ids[b * block_size:(b + 1) * block_size])
        out.append(key)
    return out


@dataclass
class Stored:
    block_hashes: list
    parent_block_hash: object
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: int | None = None


@dataclass
class Removed:
    block_hashes: list
    medium: str | None = None
    group_idx: int | None = None


@dataclass
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass
class EngineCacheView:
    """One engine's prefix cache, by chain key."""

    max_blocks: int = 1 << 22  # a bound on what one engine's events can make the router hold
    by_hash: dict = field(default_factory=dict)  # engine block hash -> chain key
    held: dict[int, int] = field(default_factory=dict)  # chain key -> engine blocks holding it
    block_size: int = 0  # the engine's (its events say)
    last_seq: int | None = None
    exact: bool = False  # every batch since the engine started has been applied
    resyncs: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)

    # ---- sequence ----
    def wants_replay(self, seq: int) -> int | None:
        """A batch ``seq`` arrived: the first sequence number to ask the replay buffer for, if a gap is
        before it (None: apply it now)."""
        if self.last_seq is None:
            return 0 if seq > 0 else None  # a first look: what the engine published before, if it still has it
        if seq <= self.last_seq:
            return None  # a restart (or a replayed batch): on_batch decides
        return self.last_seq + 1 if seq > self.last_seq + 1 else None

    def check_restart(self, seq: int) -> bool:
        """A live batch ``seq`` whose number did not go up: the engine restarted, and its sequence began
        again. The view is cleared (counted) and starts over, as on a first look (``wants_replay``)."""
        if self.last_seq is None or seq > self.last_seq:
            return False
        self.clear("restart")
        self.last_seq = None
        return True

    def on_batch(self, seq: int, events: Iterable[Event], replayed: bool = False) -> None:
        """Apply a batch in order. A replayed batch already applied is dropped; a live one whose number did
        not go up is a restarted engine, and one past a gap the replay could not fill lost events: either
        clears the view first (counted)."""
        if self.last_seq is not None and seq <= self.last_seq:
            if replayed:
                return
            self.clear("restart")
            self.exact = seq == 0  # it is seen from its start again
        elif self.last_seq is None:
            self.exact = seq == 0
            if seq:
                self._count(self.resyncs, "joined_late")
        elif seq != self.last_seq + 1:
            self.clear("gap")
        self.last_seq = seq
        for e in events:
            self._apply(e)

    def lost(self, seq: int, reason: str) -> None:
        """Batch ``seq`` could not be read: the view starts again after it."""
        self.clear(reason)
        self.last_seq = seq

    def clear(self, reason: str) -> None:
        self.by_hash.clear()
        self.held.clear()
        self.exact = False
        self._count(self.resyncs, reason)

    # ---- events ----
    def _apply(self, e: Event) -> None:
        if isinstance(e, Cleared):
            self.by_hash.clear()
            self.held.clear()
        elif isinstance(e, Removed):
            if e.medium not in (None, "GPU") or e.group_idx not in (None, 0):
                return  # another tier's or group's copy went: the one the view counts may still be there
            for h in e.block_hashes:
                key = self.by_hash.pop(_hkey(h), None)
                if key is not None:
                    n = self.held.get(key, 0) - 1
                    if n > 0:
                        self.held[key] = n
                    else:
                        self.held.pop(key, None)
        elif isinstance(e, Stored):
            self._stored(e)

    def _stored(self, e: Stored) -> None:
        why = self._unmatchable(e)
        if why:
            self._count(self.skipped, why, len(e.block_hashes))
            return
        bs = e.block_size
        if bs <= 0 or len(e.token_ids) < bs * len(e.block_hashes):
            self._count(self.skipped, "malformed", len(e.block_hashes))
            return
        if e.parent_block_hash is None:
            key = ROOT
        else:
            key = self.by_hash.get(_hkey(e.parent_block_hash))
            if key is None:
                self._count(self.skipped, "unknown_parent", len(e.block_hashes))
                return
        self.block_size = bs
        for i, h in enumerate(e.block_hashes):
            key = chain(key, e.token_ids[i * bs:(i + 1) * bs])
            hk = _hkey(h)
            if hk in self.by_hash:
                continue  # stored again (a re-emitted hit): held once per engine block
            if len(self.by_hash) >= self.max_blocks:
                self._count(self.skipped, "over_max_blocks", len(e.block_hashes) - i)
                return
            self.by_hash[hk] = key
            self.held[key] = self.held.get(key, 0) + 1

    @staticmethod
    def _unmatchable(e: Stored) -> str:
        if e.lora_id is not None or e.lora_name is not None:
            return "lora"
        if e.extra_keys and any(k is not None for k in e.extra_keys):
            return "extra_keys"
        if e.group_idx not in (None, 0):
            return "other_group"
        if e.medium not in (None, "GPU"):
            return "other_medium"
        return ""

    # ---- queries ----
    def held_tokens(self, token_ids: list[int], keys: dict[int, list[int]] | None = None) -> int:
        """Leading prompt tokens this engine's cache holds (whole blocks). ``keys``: the prompt's chain keys
        by block size, filled here as needed, so that several engines' views hash a prompt once."""
        if not self.block_size or not self.held:
            return 0
        if keys is None:
            keys = {}
        if self.block_size not in keys:
            keys[self.block_size] = prompt_keys(token_ids, self.block_size)
        n = 0
        for key in keys[self.block_size]:
            if key not in self.held:
                break
            n += 1
        return n * self.block_size

    def stats(self) -> dict:
        return {"blocks": len(self.by_hash), "exact": self.exact, "last_seq": self.last_seq,
                "resyncs": dict(self.resyncs), "skipped": dict(self.skipped)}

    @staticmethod
    def _count(table: dict[str, int], key: str, n: int = 1) -> None:
        table[key] = table.get(key, 0) + n


def _hkey(h) -> object:
    """An engine block hash as a dict key: an int (vLLM's default) or bytes."""
    return bytes(h) if isinstance(h, (bytes, bytearray, memoryview)) else h
