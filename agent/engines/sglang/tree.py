"""The pages of SGLang's radix tree: which pool page holds which key, walked from the root.

SGLang 0.5.23 runs its unified radix cache on a compiled tree core
(``RustUnifiedTreeCore``, on CPU and CUDA alike). That core walks itself —
``walk_for_kv_canary`` lists every device slot of every node, depth-first
from each root, with its position and the slot before it on its path — but
it hands out neither a node's token ids nor its id from a walk. What names a
page is its storage key (SGLang's chained page hash, the key a restore looks
up), and the tree gives that out in one place: every node it inserts is
offered to the external linker (``offload``, a write-through chain of the
new leaf and every ancestor not yet stored, with the pages' keys and device
slots), and the linker never accepts, so every later insert beneath a node
offers it again. :class:`TreeIndex` keeps what those offers said, per pool
page: its key and the node that held it (a page's slots can belong to a new
node only through a new insert, which is offered again, so the walk never
meets a page whose entry is stale). A capture walks the tree and names each
page from the index; a page no offer named (none is expected) is counted,
never guessed.

Pins: a lock reference on a node holds its whole root path, so a page is
held by the lock of the node it was offered under, or of any node below it
(a node split since keeps its pages on that node's path). :meth:`walk`
gives each page such a node; a page with none is copied at the consistent
point. The index is bounded by the pool (one entry per page).

No SGLang import (the walk's input is the core's own result, duck-typed):
tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TreeIndex", "TreePage", "Walk"]


@dataclass(frozen=True)
class TreePage:
    """A full page of the tree: its key, its pool page number, the node whose lock holds it."""

    key: bytes
    page: int
    pin: int | None


@dataclass(frozen=True)
class Walk:
    """The tree's pages at one step boundary, and how many of them no offer named."""

    pages: list[TreePage]
    unnamed: int


class TreeIndex:
    """Pool page → (key, node) as the tree's offers named them (scheduler thread only)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[int, tuple[bytes, int | None]] = {}

    def learn(self, keys: list[str], slots: torch.Tensor, node: int | None) -> None:
        """A node's pages, as an offer or a load names them: ``keys[i]`` is held by slots
        ``slots[i·p : (i+1)·p]``."""
        p = self.page_size
        n = min(len(keys), int(slots.numel()) // p)
        if n <= 0:
            return
        firsts = slots[: n * p : p].tolist()
        for k, first in zip(keys[:n], firsts, strict=True):
            self.pages[int(first) // p] = (bytes.fromhex(k), node)

    def clear(self) -> None:
        self.pages.clear()

    def walk(self, core: Any) -> Walk:
        """Every full device page of ``core``'s tree (a tree core's ``walk_for_kv_canary``), each
        with the node whose lock holds it: its own, else one below it."""
        p = self.page_size
        w = core.walk_for_kv_canary(False, False)
        pos = w.positions
        if pos.numel() == 0:
            return Walk([], 0)
        first = pos % p == 0  # a page starts here (tree values are page-aligned)
        starts = w.slot_indices[first]
        prev = w.prev_slot_indices[first]
        pages = (starts // p).tolist()
        parents = torch.where(prev >= 0, prev // p, torch.full_like(prev, -1)).tolist()
        own = [self.pages.get(pg) for pg in pages]
        # depth-first order: a node's pages come before its children's, so backwards every page
        # is seen after everything below it, and hands its pinning node up to its parent page
        below: dict[int, int] = {}
        out: list[TreePage] = []
        unnamed = 0
        for i in range(len(pages) - 1, -1, -1):
            rec = own[i]
            pin = rec[1] if rec is not None and rec[1] is not None else below.get(pages[i])
            if pin is not None and parents[i] >= 0:
                below.setdefault(parents[i], pin)
            if rec is None:
                unnamed += 1
            else:
                out.append(TreePage(rec[0], pages[i], pin))
        out.reverse()
        return Walk(out, unnamed)
