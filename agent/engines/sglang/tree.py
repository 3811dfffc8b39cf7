"""The pages of SGLang's radix tree: which pool page holds which key, walked from the root.

SGLang 0.5.23 runs its unified radix cache on a compiled tree core
(``RustUnifiedTreeCore``, on CPU and CUDA alike). That core walks itself —
``all_values_flatten`` concatenates its nodes' device slots depth-first, and
``walk_for_kv_canary`` lists every device slot with its position and the
slot before it on its path — but it hands out neither a node's token ids
nor its id from a walk. What names a
page is its storage key (SGLang's chained page hash, the key a restore looks
up), and the tree gives that out in one place: every node it inserts is
offered to the external linker (``offload``, a write-through chain of the
new leaf and every ancestor not yet stored, with the pages' keys and device
slots), and the linker never accepts, so every later insert beneath a node
offers it again. :class:`TreeIndex` keeps what those offers said, per pool
page: its key and the node that held it (a page's slots can belong to a new
node only through a new insert, which is offered again, so the walk never
meets a page whose entry is stale). A capture walks the tree; a page no
offer named (none is expected) is counted, never guessed.

Pins: a lock reference on a node holds its whole root path, so a page is
held by the lock of the node it was offered under, or of any node below it
(a node split since keeps its pages on that node's path). :meth:`walk`
gives each page such a node; a page with none is copied at the consistent
point.

Cost: the walk is tensor work (the nodes' slots, the index's node per page,
and — only while the tree holds pages a restore loaded — the core's walk of
every slot's position, for the pins of pages with no node of their own,
found by a range minimum over the walk's depths); no Python runs per page. A page's key is looked up when
its page is taken for a chunk (:meth:`keys`): the key a pinned page was
offered under cannot change while the lock holds it — its slots are not
freed, so no insert or load names them anew — and a flush (:meth:`clear`,
after the linker has ended every stream) is seen by its generation. The
index is bounded by the pool (one entry per page).

No SGLang import (the walk's input is the core's own result, duck-typed):
tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["NO_NODE", "UNNAMED", "TreeIndex", "Walk"]

#: a page's node in :attr:`TreeIndex.nodes`: named by a load, not by a node's offer
NO_NODE = -1
#: a page's node in :attr:`TreeIndex.nodes`: no offer or load named it
UNNAMED = -2


@dataclass(frozen=True)
class Walk:
    """The tree's named full pages at one step boundary, in the walk's (depth-first) order: their
    pool page numbers and the node whose lock holds each (:data:`NO_NODE`: none; copied at the
    consistent point), and how many pages no offer named."""

    pages: torch.Tensor  # int64
    pins: torch.Tensor  # int64
    unnamed: int
    generation: int = 0


class TreeIndex:
    """Pool page → (key, node) as the tree's offers named them (scheduler thread only)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.key_of: dict[int, bytes] = {}  # pool page → key
        self.nodes = torch.full((0,), UNNAMED, dtype=torch.int64)  # pool page → node
        self.generation = 0  # bumped by clear(): names looked up later belong to a new tree

    def __len__(self) -> int:
        return len(self.key_of)

    def _room(self, pages: int) -> None:
        if pages > self.nodes.numel():
            grown = torch.full((max(pages, 2 * self.nodes.numel()),), UNNAMED, dtype=torch.int64)
            grown[: self.nodes.numel()] = self.nodes
            self.nodes = grown

    def learn(self, keys: list[str], slots: torch.Tensor, node: int | None) -> None:
        """A node's pages, as an offer or a load names them: ``keys[i]`` is held by slots
        ``slots[i·p : (i+1)·p]``."""
        p = self.page_size
        n = min(len(keys), int(slots.numel()) // p)
        if n <= 0:
            return
        firsts = (slots[: n * p : p].to(device="cpu", dtype=torch.int64) // p).tolist()
        self._room(max(firsts) + 1)
        self.nodes[torch.tensor(firsts, dtype=torch.int64)] = NO_NODE if node is None else int(node)
        for k, page in zip(keys[:n], firsts, strict=True):
            self.key_of[page] = bytes.fromhex(k)

    def clear(self) -> None:
        self.key_of.clear()
        self.nodes.fill_(UNNAMED)
        self.generation += 1

    def keys(self, pages: list[int], generation: int) -> list[bytes]:
        """The keys of ``pages`` (pool page numbers of one walk of ``generation``)."""
        if generation != self.generation:
            raise LookupError("the radix tree was flushed since its pages were walked")
        try:
            return [self.key_of[pg] for pg in pages]
        except KeyError as exc:
            raise LookupError(f"pool page {exc.args[0]} lost its name since the walk") from None

    def walk(self, core: Any, *, pin_below: bool = True) -> Walk:
        """Every named full device page of ``core``'s tree, depth-first, each with the node whose
        lock holds it: its own, else one below it (else, or without ``pin_below``,
        :data:`NO_NODE`).

        The tree's device slots come from the core's ``all_values_flatten`` (its nodes' values
        concatenated: a copy per node). Only a page with no node of its own (one a restore loaded)
        needs its depth, to find a node below it; then the walk is ``walk_for_kv_canary``, which
        lists every slot with its position — at 8× the KV most of the consistent point — so it is
        taken only while such pages are in the tree."""
        p = self.page_size
        empty = torch.empty(0, dtype=torch.int64)
        flat = getattr(core, "all_values_flatten", None)
        if flat is not None:
            slots = flat().to(dtype=torch.int64, device="cpu")
            if slots.numel() == 0:
                return Walk(empty, empty, 0, self.generation)
            pages = slots[slots % p == 0] // p  # a page starts here (tree values are page-aligned)
            self._room(int(pages.max()) + 1)
            own = self.nodes[pages]
            if not pin_below or not bool((own == NO_NODE).any()):
                named = own != UNNAMED
                return Walk(pages[named], own[named], int((~named).sum()), self.generation)
        w = core.walk_for_kv_canary(False, False)
        pos = w.positions
        if pos.numel() == 0:
            return Walk(empty, empty, 0, self.generation)
        first = pos % p == 0
        pages = (w.slot_indices[first] // p).to(dtype=torch.int64, device="cpu")
        depth = pos[first].to(dtype=torch.int64, device="cpu")
        self._room(int(pages.max()) + 1)
        own = self.nodes[pages]
        pins = own.clone()
        orphans = (own == NO_NODE).nonzero().flatten()  # named, no node of its own: one below
        if orphans.numel() and pin_below:
            pins[orphans] = _pin_below(own, depth, orphans)
        named = own != UNNAMED
        return Walk(pages[named], pins[named], int((~named).sum()), self.generation)


def _pin_below(own: torch.Tensor, depth: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """For the pages ``at`` of a depth-first walk: the node of a page below each (:data:`NO_NODE`
    if none). A page's subtree is the run of pages after it that are deeper than it; the first page
    with a node of its own after ``i`` is below ``i`` iff every page up to it is deeper than ``i``."""
    n = own.numel()
    idx = torch.arange(n, dtype=torch.int64)
    has = own >= 0
    nxt = torch.where(has, idx, torch.full_like(idx, n)).flip(0).cummin(0).values.flip(0)
    after = torch.clamp(at + 1, max=n - 1)
    j = nxt[after]
    ok = (at + 1 < n) & (j < n)
    lo, hi = at[ok] + 1, j[ok]
    below = torch.full_like(at, NO_NODE)
    if lo.numel():
        deeper = _range_min(depth, lo, hi) > depth[at[ok]]
        below[ok.nonzero().flatten()[deeper]] = own[hi[deeper]]
    return below


def _range_min(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``min(x[lo[q] : hi[q] + 1])`` for each query (``lo <= hi``), by a sparse table."""
    n = x.numel()
    big = torch.iinfo(torch.int64).max
    table = [x]
    while (1 << len(table)) <= n:
        half = 1 << (len(table) - 1)
        prev = table[-1]
        shifted = torch.cat([prev[half:], torch.full((half,), big, dtype=prev.dtype)])
        table.append(torch.minimum(prev, shifted))
    span = hi - lo + 1
    level = torch.zeros_like(span)
    while bool(((2 << level) <= span).any()):
        level += ((2 << level) <= span).to(torch.int64)
    levels = torch.stack(table)
    return torch.minimum(levels[level, lo], levels[level, hi - (1 << level) + 1])
