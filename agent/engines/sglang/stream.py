"""The SGLang linker's capture stream: one consistent point, then the cached pages chunk by chunk.

The bookkeeping of one capture (no SGLang or torch import, so it is tested on
its own); the linker (:mod:`.linker`) drives it on the scheduler thread and
answers the agent's ``next`` calls from it. Why a capture can be spread over
steps:

- A page of the radix tree never changes while a lock reference holds its
  node: SGLang writes only slots a request owns, and a tree page is freed
  (and its slots reused) only by eviction, which skips locked nodes. The
  consistent point locks (``inc_lock_ref``) the nodes holding the tree's
  pages; each page is then copied at some later step, and a node's lock is
  released (``dec_lock_ref``) as soon as its last page is copied — or when
  the stream ends for any reason (done, cancelled, failed, abandoned, the
  cache flushed).
- What can change after the consistent point is copied at it (chunk 0): the
  live requests' pages outside the tree (decode KV, their partial tails) and
  tree pages no lock could hold.

The pinned pages are planned as page numbers and their pinning nodes only
(:class:`Planned`, tensors from the tree walk): each page's key is looked up
as its chunk is taken, so the consistent point costs per node, not per page.
A key met twice (a tree page a live request's chunk-0 page already carries)
is copied once; the page left out still counts off its pin.

The pinned pages follow ``chunk_pages`` at a time, at most ``ring`` chunks
staged at once (written, being written or not yet acknowledged by the
agent): that is the backpressure. Chunk files are written off the scheduler
thread; a chunk is reported complete when its file is — on a tensor-parallel
server, when every rank's file of it is (each rank writes its own heads of
the same pages, :mod:`.ranks`).

A stream with no word from the agent for ``idle_timeout`` seconds is
abandoned (a killed agent): its staged chunks are deleted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from agent.engines.streams import StreamBook

__all__ = ["Pending", "Pin", "Planned", "Stream"]


class Pending(NamedTuple):
    """A page to copy: its key, its page number in the KV pools (slots ``page·p … page·p + p - 1``),
    the tree node whose lock holds it (None: copied at the consistent point) and, for a partial
    tail, how many of its slots are valid (the rest are zeroed)."""

    key: bytes
    page: int
    pin: int | None = None
    valid: int | None = None


def _ints(x: Any) -> list[int]:
    return list(x.tolist() if hasattr(x, "tolist") else x)


class Planned:
    """The pinned pages still to copy, in order: pool page numbers and their pinning nodes (any
    sliceable int sequences, tensors included), named as they are taken by ``name(pages)`` (a
    page's key; raises :class:`LookupError` when one can no longer be named)."""

    def __init__(self, pages: Any, pins: Any, name: Callable[[list[int]], list[bytes]]) -> None:
        self.pages = pages
        self.pins = pins
        self.name = name
        self.at = 0

    def __len__(self) -> int:
        return len(self.pages) - self.at

    def take(self, n: int) -> list[Pending]:
        """The next ``n`` pages at most, named."""
        lo, hi = self.at, min(len(self.pages), self.at + max(0, n))
        pages, pins = _ints(self.pages[lo:hi]), _ints(self.pins[lo:hi])
        keys = self.name(pages)
        self.at = hi
        return [Pending(k, pg, pin) for k, pg, pin in zip(keys, pages, pins, strict=True)]


@dataclass
class Pin:
    """A lock reference the stream holds on a tree node: the engine's release receipt, and how many
    of the stream's pages it still holds."""

    lock: Any
    left: int = 0


@dataclass(kw_only=True)
class Stream(StreamBook):
    """One capture in flight. Every method runs under the linker's lock; the pins are touched on
    the scheduler thread only (the tree is not thread-safe)."""

    first_in_complete: ClassVar[bool] = False  # chunk 0 answers the capture call itself

    pending: Planned
    pins: dict[int, Pin] = field(default_factory=dict)  # node → its lock, pages it still holds
    seen: set[bytes] = field(default_factory=set)  # keys taken (chunk 0's included): copied once
    dropped: list[Pending] = field(default_factory=list)  # taken pages whose key was taken before
    ended: bool = False  # the linker closed it (its locks are released or announced)

    def has_pending(self) -> bool:
        return bool(self.pending)

    # -- the scheduler thread --

    def take(self, n: int | None = None) -> list[Pending]:
        """The next chunk's pages (``n``, else ``chunk_pages``, at most), named; a key taken before
        is left out (its pin is counted off by :meth:`copied`). Raises :class:`LookupError` (from
        the naming) when a page can no longer be named: the stream cannot go on."""
        n = self.chunk_pages if n is None else n
        out: list[Pending] = []
        while self.pending and len(out) < n:
            for pg in self.pending.take(n - len(out)):
                if pg.key in self.seen:
                    self.dropped.append(pg)
                else:
                    self.seen.add(pg.key)
                    out.append(pg)
        return out

    def copied(self, pages: list[Pending]) -> list[Pin]:
        """``pages`` are off the pools (and the pages left out as taken before are done with): the
        pins that hold nothing more, taken out (to release)."""
        done = []
        dropped, self.dropped = self.dropped, []
        for p in (*pages, *dropped):
            pin = self.pins.get(p.pin) if p.pin is not None else None
            if pin is None:
                continue
            pin.left -= 1
            if pin.left <= 0:
                done.append(self.pins.pop(p.pin))  # type: ignore[arg-type]
        return done

    def take_pins(self) -> list[Pin]:
        """Every pin still held, taken out (the stream ends: release them)."""
        out = list(self.pins.values())
        self.pins.clear()
        return out
