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
thread; a chunk is reported complete when its file is.

A stream with no word from the agent for ``idle_timeout`` seconds is
abandoned (a killed agent): its staged chunks are deleted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["DEFAULT_COPY_PER_STEP", "DEFAULT_MAX_STAGING", "Pending", "Pin", "Planned", "Stream", "chunk_pages"]

#: default bound on the host memory a capture stages (page files not yet consumed by the agent)
DEFAULT_MAX_STAGING = 256 << 20
#: default bytes of pinned pages copied per scheduler step after the consistent point
DEFAULT_COPY_PER_STEP = 16 << 20
#: the fewest chunks the staging bound should hold: one the agent reads while the next is written
RING = 2


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


def chunk_pages(page_bytes: int, *, max_staging: int, copy_per_step: int) -> tuple[int, int]:
    """``(pages per chunk, chunks staged at most)``: a chunk is at most ``copy_per_step`` bytes, and
    the staged chunks take at most half of ``max_staging`` — at least two where the bound allows,
    so the scheduler copies one while the agent reads another (the other half is for pages of read
    chunks still queued in the agent's save, as for vLLM)."""
    page_bytes = max(1, page_bytes)
    half = max_staging // 2
    pages = max(1, min(copy_per_step // page_bytes, half // (RING * page_bytes)))
    return pages, max(1, half // (pages * page_bytes))


@dataclass
class Stream:
    """One capture in flight. Every method runs under the linker's lock; the pins are touched on
    the scheduler thread only (the tree is not thread-safe)."""

    seq: int
    name: str
    directory: str
    info: dict[str, Any]  # the consistent point's facts: ledger, counts, timings
    pending: Planned
    chunk_pages: int
    page_bytes: int
    max_staging: int
    ring: int = RING
    prefix_only: bool = False
    idle_timeout: float = 300.0
    waiters: list[Any] = field(default_factory=list)  # capture calls answered with chunk 0
    pins: dict[int, Pin] = field(default_factory=dict)  # node → its lock, pages it still holds
    seen: set[bytes] = field(default_factory=set)  # keys taken (chunk 0's included): copied once
    dropped: list[Pending] = field(default_factory=list)  # taken pages whose key was taken before
    issued: int = 0
    acked: set[int] = field(default_factory=set)
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)  # chunk → its page file's report
    complete: deque[int] = field(default_factory=deque)  # written, not yet handed out
    chunk_pages_of: dict[int, int] = field(default_factory=dict)
    error: str | None = None
    last_chunk: int | None = None  # set once nothing is pending after a chunk is issued
    staged_bytes: int = 0
    peak_staged: int = 0
    copied_pages: int = 0
    max_copy_s: float = 0.0  # the longest a chunk's copy held up the scheduler
    touched: float = field(default_factory=time.monotonic)
    issued_at: dict[int, float] = field(default_factory=dict)
    latency: float = 0.0  # sum over chunks of issue → written

    # -- the scheduler thread --

    def can_issue(self) -> bool:
        unacked = self.issued - len(self.acked)
        return self.error is None and self.last_chunk is None and unacked < self.ring

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

    def issue(self, pages: int, copy_s: float) -> int:
        """Record chunk ``issued`` (``pages`` pages, copied off the pools in ``copy_s``)."""
        k = self.issued
        self.issued += 1
        self.chunk_pages_of[k] = pages
        self.issued_at[k] = time.monotonic()
        self.staged_bytes += pages * self.page_bytes
        self.peak_staged = max(self.peak_staged, self.staged_bytes)
        self.max_copy_s = max(self.max_copy_s, copy_s)
        if not self.pending:
            self.last_chunk = k
        return k

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

    # -- the writer threads --

    def report(self, chunk: int, rec: dict[str, Any]) -> None:
        """Chunk ``chunk``'s page file is written (or failed: ``rec["error"]``)."""
        self.reports[chunk] = rec
        if rec.get("error"):
            self.error = self.error or f"chunk {chunk}: {rec['error']}"
            return
        self.latency += time.monotonic() - self.issued_at.get(chunk, time.monotonic())
        self.copied_pages += self.chunk_pages_of.get(chunk, 0)
        if chunk > 0:  # chunk 0 answers the capture call itself
            self.complete.append(chunk)

    # -- the control threads --

    @property
    def done(self) -> bool:
        """Every chunk up to the last acknowledged."""
        return self.last_chunk is not None and len(self.acked) == self.last_chunk + 1

    def ack(self, chunk: int) -> None:
        if chunk in self.acked or chunk >= self.issued:
            return
        self.acked.add(chunk)
        self.staged_bytes -= self.chunk_pages_of.get(chunk, 0) * self.page_bytes
        self.touched = time.monotonic()

    def idle(self, now: float) -> bool:
        """No word from the agent for ``idle_timeout`` s (a killed agent: nobody reads the chunks)."""
        return now - self.touched > self.idle_timeout

    def part(self, k: int) -> dict[str, Any]:
        """Chunk ``k`` as a reply part."""
        return {"chunk": k, "shards": [dict(self.reports[k])], "last": k == self.last_chunk, "lost": []}

    def hand_out(self) -> dict[str, Any] | None:
        """The first complete chunk not yet handed out, as a reply part, or None."""
        if not self.complete:
            return None
        self.touched = time.monotonic()
        return {**self.part(self.complete.popleft()), "staged_peak_bytes": self.peak_staged}

    def files(self) -> list[str]:
        """Every page file this stream wrote that the agent has not acknowledged."""
        return [str(r["index"]) for k, r in self.reports.items() if k not in self.acked and r.get("index")]

    def summary(self) -> dict[str, Any]:
        return {
            "chunks": self.issued,
            "copied_pages": self.copied_pages,
            "lost_pages": 0,
            "staged_peak_bytes": self.peak_staged,
            "max_staging_bytes": self.max_staging,
            "chunk_pages": self.chunk_pages,
            "ring": self.ring,
            "mean_chunk_latency_s": self.latency / max(1, len(self.reports)),
            "max_chunk_copy_s": self.max_copy_s,
        }
