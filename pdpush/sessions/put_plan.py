"""A request's put plan (pure): what the sender's native per-layer path (``native/src/pusher.cpp``)
needs to post any layer of the request without the interpreter, decided once its allocation is known.

The plan names every address the native path may touch, so nothing comes from the shared segment an
engine can write (its ring records only say which layers are ready):

  * per layer: its group, its place in the receiver's pool, its readiness words there, and the bytes
    of its staging block (0: nothing new to move, the layer lands as it is handed over);
  * per group: the readiness puts (the request's lease words in staging to the pool's words);
  * per rank: its share of each group's layer as (offset in the layer's block, offset in the pool, bytes)
    (``layout.StagingShares.ranges``); a state layer's share is the rank's units of its state page;
  * per granted layer: its block's offset (``PlanGrants``, from ``grants.py``).

Groups are the layout's attention groups by index, then one for the state layers (no readiness words:
the commit says). The native path refuses a hand-over it cannot take and says why (``REFUSED``); the
session answers the engine.
"""

from __future__ import annotations

from pdpush.layout import READY_WORD
from pdpush.sessions.tx_request import TxRank, TxRequest

Span = tuple[int, int, int]

# why the native path refused a hand-over (pusher.cpp's Refusal)
UNKNOWN, NOT_YOURS, RANGE, DUPLICATE, UNGRANTED = 1, 2, 3, 4, 5


def layers(r: TxRequest) -> list[tuple[int, int, int, int]]:
    """(group, pool address, readiness words' pool address, staging block bytes) of every layer pushed."""
    lay, pool, ack = r.layout, r.pool, r.peer.ack
    out = []
    for layer in range(lay.push_layers):
        if lay.is_state(layer):
            dst = ack.pool_base + pool.state_at(r.state_slot) + (layer - lay.layers) * lay.state_page_bytes
            out.append((len(r.plan.groups), dst, 0, r.plan.layer_bytes(layer)))
        else:
            out.append((r.plan.of(layer).group.index, ack.pool_base + layer * pool.layer_bytes,
                        ack.ready_base + layer * ack.pool_pages * READY_WORD, r.plan.layer_bytes(layer)))
    return out


def ready(r: TxRequest, words: int) -> list[list[Span]]:
    """By group: the readiness puts of a layer, from the request's lease words at ``words`` in staging."""
    return [[(words + (gp.new_first + idx) * READY_WORD, page * READY_WORD, n * READY_WORD)
             for idx, page, n in gp.page_runs] for gp in r.plan.groups] + [[]]


def ranges(r: TxRequest, k: TxRank) -> list[list[Span]]:
    """By group: rank ``k``'s share of one of the group's layers, relative to its block and pool place."""
    out = [sh.ranges(0, k.tp_rank, gp.page_runs, r.pool) for sh, gp in zip(r.shares, r.plan.groups, strict=True)]
    page = r.layout.state_page_bytes
    mine = k.tp_rank * page // r.tp
    return out + [[(mine, mine, page // r.tp)] if r.layout.state_layers else []]


def layer_puts(r: TxRequest) -> list[int]:
    """By layer pushed: the puts of one rank's share of it (a state layer's: one)."""
    out = [1] * r.layout.push_layers
    for sh, gp in zip(r.shares, r.plan.groups, strict=True):
        puts = sh.puts(gp.page_runs)
        for layer in gp.group.layers:
            out[layer] = puts
    return out


def share_spans(r: TxRequest, layer: int, staging: int) -> list[tuple[int, int]]:
    """Each TP rank's share of ``layer`` in staging as (address, bytes), in rank order: what its checksum
    covers (``layout.combine_digests``)."""
    block = staging + r.grant.blocks[layer]
    if r.layout.is_state(layer):
        page = r.layout.state_page_bytes
        return [(block + t * page // r.tp, page // r.tp) for t in range(r.tp)]
    sh = r.shares[r.plan.of(layer).group.index]
    return [(block + sh.share_offset(0, t), sh.share_bytes) for t in range(r.tp)]


def refusal(why: int, r: TxRequest, k: TxRank | None, first: int, n: int) -> str:
    """The engine's error for a hand-over the native path refused."""
    span = f"layer {first}" if n == 1 else f"layers [{first}, {first + n})"
    if why == UNGRANTED:
        return f"{span} handed over before the sender granted its staging"
    stage = f" (this stage's [{k.layers.start}, {k.layers.stop}))" if k is not None else ""
    return f"{span} out of range{stage} or already sent"
