"""Tensor-parallel shards of KV pages, and the TP-independent page they join into (no vLLM import).

vLLM shards a model's ``H`` KV heads across ``tp`` ranks: rank ``r`` holds
``n = max(1, H // tp)`` heads from ``r * H // tp`` (with ``tp > H`` several
ranks hold the same head — replicas; an MLA model has one latent "head"
that every rank holds). A page in a *rank's* page file is
``[layers, *layer_page]`` with ``n`` heads on axis ``head_axis`` of
``layer_page``; a *stored* page (what the repository keeps, see
``ckpt/FORMAT.md`` §"KV pages and heads") has all ``H`` heads there, in head
order. Per-head slices of a layer's page are independent on every layout
gpuckpt reads (the CPU backend and vLLM 0.33's logical
``[blocks, head slots, tokens, content]`` views), so joining shards and
splitting pages are plain copies along that axis. A stored page therefore
restores into a worker of any TP size with the same total heads, head size,
dtype and per-head page format. (One exception: where a state group runs at
TP above the model's KV heads, a stored page has one slot per rank instead,
:func:`rank_slot`, and restores onto the same TP size only.)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckpt.blocks import DTYPES
from ckpt.errors import GpuckptError


class ShardError(GpuckptError):
    """The ranks' shards of a capture or a checkpoint do not make whole pages; names the rank."""


@dataclass(frozen=True)
class Heads:
    """The KV heads one rank holds: ``count`` heads from ``start`` of ``total``."""

    start: int
    count: int
    total: int

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.start, self.count, self.total)


def local_heads(rank: int, tp: int, total: int, count: int) -> Heads:
    """The heads of ``rank`` in a ``tp``-way worker of a model with ``total`` KV heads.

    ``count`` is what the rank's KV tensors hold; it must be vLLM's
    ``max(1, total // tp)`` (anything else means a sharding this code does
    not know, refused rather than guessed).
    """
    if not 0 <= rank < tp:
        raise ShardError(f"rank {rank} outside a tensor-parallel group of {tp}")
    expect = max(1, total // tp)
    if count != expect:
        raise ShardError(
            f"rank {rank} of {tp}: KV tensors hold {count} heads, expected {expect} of the model's {total}"
        )
    if tp > total and tp % total:
        raise ShardError(f"{tp} ranks cannot replicate {total} KV heads evenly")
    return Heads(rank * total // tp, count, total)


def rank_slot(rank: int, tp: int, count: int) -> Heads:
    """The head slot of ``rank`` where a stored page holds one slot per rank rather than the
    model's heads (a worker whose pages carry per-rank state while its ranks replicate attention
    heads, see :func:`agent.engines.vllm.groups.page_heads`): slot ``rank`` of ``tp``, which gives
    each rank its own bytes back at the writer's TP size only (a pin keeps it there)."""
    if not 0 <= rank < tp:
        raise ShardError(f"rank {rank} outside a tensor-parallel group of {tp}")
    if count != 1:
        raise ShardError(f"rank {rank} of {tp}: KV tensors hold {count} heads, expected 1 (replicas)")
    return Heads(rank, 1, tp)


def full_shape(shard_shape: Sequence[int], head_axis: int, total: int) -> tuple[int, ...]:
    """The shape of a stored page (``[layers, *layer_page]``) for a rank's page shape."""
    s = list(shard_shape)
    s[1 + head_axis] = total
    return tuple(s)


def check_cover(shards: Sequence[dict[str, Any]], total: int, tp: int) -> None:
    """Every rank ``0..tp-1`` present once, and their heads covering ``[0, total)``.

    ``shards`` are the records of a capture (or a manifest's ``layout["shards"]``):
    ``{"rank", "kv_heads": [start, count]}``. Raises :class:`ShardError`
    naming the rank that is missing, duplicated or inconsistent.
    """
    ranks = [int(s["rank"]) for s in shards]
    for r in range(tp):
        if ranks.count(r) != 1:
            raise ShardError(
                f"rank {r}'s part is {'missing' if r not in ranks else 'present twice'} "
                f"({len(shards)} of {tp} ranks' parts)"
            )
    extra = sorted(set(ranks) - set(range(tp)))
    if extra:
        raise ShardError(f"rank {extra[0]}'s part does not belong to a {tp}-way worker")
    covered = np.zeros(total, dtype=bool)
    for s in shards:
        start, count = (int(x) for x in s["kv_heads"])
        expect = local_heads(int(s["rank"]), tp, total, count)
        if start != expect.start:
            raise ShardError(f"rank {s['rank']}'s part holds heads from {start}, expected {expect.start}")
        covered[start : start + count] = True
    if not covered.all():
        raise ShardError(f"heads {np.flatnonzero(~covered).tolist()} are in no rank's part")


def join(
    shard_pages: Sequence[Iterator[memoryview]],
    shards: Sequence[dict[str, Any]],
    *,
    dtype: str,
    shard_shape: Sequence[int],
    head_axis: int,
    total: int,
) -> Iterator[memoryview]:
    """Join the ranks' pages of each block (one iterator per rank, same key order) into stored pages.

    With one rank holding every head the pages pass through uncopied.
    Replicas (several ranks holding one head) contribute once, from the lowest rank.
    """
    if len(shard_pages) == 1 and int(shards[0]["kv_heads"][1]) == total:
        yield from shard_pages[0]
        return
    itemsize = DTYPES[dtype]
    np_dtype = np.dtype(f"V{itemsize}")  # opaque elements: any dtype, no conversion
    shape = tuple(shard_shape)
    out_shape = full_shape(shape, head_axis, total)
    axis = 1 + head_axis
    firsts: dict[int, int] = {}
    for i, s in enumerate(shards):
        firsts.setdefault(int(s["kv_heads"][0]), i)
    users = sorted(firsts.items())
    while True:
        views = []
        for it in shard_pages:
            v = next(it, None)
            views.append(v)
        if all(v is None for v in views):
            return
        missing = [int(shards[i]["rank"]) for i, v in enumerate(views) if v is None]
        if missing:
            raise ShardError(f"rank {missing[0]}'s page file has fewer pages than the others")
        out = np.empty(out_shape, dtype=np_dtype)
        for start, i in users:
            a = np.frombuffer(views[i], dtype=np_dtype).reshape(shape)  # type: ignore[arg-type]
            idx: list[Any] = [slice(None)] * len(out_shape)
            idx[axis] = slice(start, start + shape[axis])
            out[tuple(idx)] = a
        yield memoryview(out.reshape(-1).view(np.uint8).data)
