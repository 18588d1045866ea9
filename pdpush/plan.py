"""A request's items by layer group: which are new, their pages, and the request's staging blocks
(pure; imports no array library).

A request's items are ``layout.items(tokens)``: (group, chunk) in order, group 0's chunks first
(layout.py). The receiver's page pool and chunk index count items, so ``already_sent_indexes``
and ``page_runs`` are over items. Both sides build the same ``RequestPlan`` from the layout, the
prompt's tokens and the held items; the sender adds the page runs, and the staging shares of its
prefill ranks.

Staging holds the layers in flight, not the request (``staging_units``): each layer with new items
is one block of its group's new pages (``StagingShares`` of ``n_g`` pages, every rank's share), and
each state layer one block of its state page. The sender grants a block when it fits and takes it
back once its layer's flush completes. The request's own metadata is its grant table, one word per
layer (``grant_words``), then a readiness word per new item, in item order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdpush.layout import READY_WORD, Group, KVLayout, runs


@dataclass
class GroupPlan:
    group: Group
    chunks: range                 # the group's chunks of this prompt (layout.group_chunks)
    first_item: int               # its first item's index among the request's items
    new_chunks: list[int]         # the chunks it writes (not held), ascending
    new_first: int                # its first new item's index among the request's new items
    page_runs: list[tuple[int, int, int]] = field(default_factory=list)  # (new item of the group, page, n)
    layout_local: tuple[int, ...] = ()  # each layer's position in its group (KVLayout.local_index)

    @property
    def n_new(self) -> int:
        return len(self.new_chunks)

    @property
    def new_runs(self) -> list[tuple[int, int, int]]:
        """The new chunks as (new item of the group, first chunk, n) runs of consecutive chunks."""
        return runs(self.new_chunks)

    def local(self, layer: int) -> int:
        """``layer``'s position among the group's layers."""
        return self.layout_local[layer]


def meta_bytes(layout: KVLayout, new_items: int) -> int:
    """A request's metadata in staging (``RequestPlan.meta_bytes``), from its count of new items alone."""
    return (layout.push_layers + new_items) * READY_WORD


class RequestPlan:
    """Items of a ``tokens``-token request, by group, with ``held`` item indexes already in the pool."""

    def __init__(self, layout: KVLayout, tokens: int, held: list[int] | tuple[int, ...] = ()) -> None:
        self.layout, self.tokens = layout, tokens
        held_set = set(held)
        self.groups: list[GroupPlan] = []
        item = new = 0
        for g in layout.groups:
            chunks = layout.group_chunks(g, tokens)
            mine = [c for i, c in zip(range(item, item + len(chunks)), chunks, strict=True) if i not in held_set]
            gp = GroupPlan(g, chunks, item, mine, new, layout_local=layout.local_index)
            item += len(chunks)
            new += len(mine)
            self.groups.append(gp)
        self.items, self.n_new = item, new
        if any(not 0 <= i < item for i in held_set):
            raise ValueError(f"held item index out of range (the request has {item} items)")
        # each layer's new bytes, once: the sender asks for them several times per layer (plan, grants, landing)
        page, state = layout.page_bytes, layout.state_page_bytes if layout.state_layers else 0
        self._layer_bytes = [state if layout.is_state(la) else self.groups[layout.group_of(la).index].n_new * page
                             for la in range(layout.push_layers)]

    @property
    def grant_words(self) -> int:
        """One per layer the push moves (``layout.push_layers``): its staging block's offset + 1, or 0."""
        return self.layout.push_layers

    @property
    def meta_bytes(self) -> int:
        """The request's metadata in staging: its grant table, then a readiness word per new item."""
        return meta_bytes(self.layout, self.n_new)

    def staging_units(self) -> list[tuple[int, int]]:
        """(layer, bytes) of every staging block the request needs: each layer with new pages, then each
        state layer."""
        return [(layer, nb) for layer in range(self.layout.push_layers) if (nb := self.layer_bytes(layer))]

    def of(self, layer: int) -> GroupPlan:
        return self.groups[self.layout.group_of(layer).index]

    def layer_bytes(self, layer: int) -> int:
        """Bytes of ``layer``'s new pages (a state layer, ``layout.is_state``: its state page)."""
        return self._layer_bytes[layer]

    @property
    def window_saved_bytes(self) -> int:
        """What the windows saved: the chunks a push of every layer's every chunk would also have moved."""
        n = self.layout.num_chunks(self.tokens)
        return sum(len(g.group.layers) * (n - len(g.chunks)) for g in self.groups) * self.layout.page_bytes

    def ready_cells(self) -> list[tuple[tuple[int, ...], list[int]]]:
        """Where the request's readiness words lie (layout.py): by group with new pages, (its layers, its new
        pages). The request has landed whole when each of these words holds its lease id."""
        return [(gp.group.layers, [p + i for _, p, n in gp.page_runs for i in range(n)])
                for gp in self.groups if gp.n_new]

    def set_pages(self, new_pages: list[int]) -> None:
        """The receiver's pages of the new items, in item order: each group's page runs."""
        if len(new_pages) != self.n_new:
            raise ValueError(f"{len(new_pages)} pages for {self.n_new} new items")
        for gp in self.groups:
            gp.page_runs = runs(new_pages[gp.new_first:gp.new_first + gp.n_new])


def tokens_of(layout: KVLayout, chunks: int, last_chunk_tokens: int) -> int:
    """A prompt's tokens, from its chunks and its last chunk's tokens (ValueError past a chunk's: a plan built from
    such a count would hold a chunk's entry for every token of it)."""
    if last_chunk_tokens > layout.chunk_tokens:
        raise ValueError(f"last_chunk_tokens {last_chunk_tokens} exceeds chunk_tokens {layout.chunk_tokens}")
    return (chunks - 1) * layout.chunk_tokens + last_chunk_tokens
