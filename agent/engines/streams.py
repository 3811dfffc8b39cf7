"""A capture stream's bookkeeping that every engine shares: chunks issued, staged, acknowledged.

A capture is one consistent point, then the pages that cannot change
(vLLM's full cached blocks, SGLang's locked tree pages) copied a chunk at a
time over the next steps. What differs by engine is how a chunk's pages are
chosen and who writes its page file (every rank of a vLLM worker; SGLang's
scheduler); what is the same is the staging ring and its backpressure, the
acknowledgements, the idle abandonment and the summary an ended stream
leaves in ``stats``: :class:`StreamBook`, subclassed by
:class:`agent.engines.vllm.capture.Stream` and
:class:`agent.engines.sglang.stream.Stream`. The ``next`` call that hands
chunks to the agent is :meth:`agent.engines.service.WorkerService.on_next`.

No engine or torch import: tested on its own.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["DEFAULT_COPY_PER_STEP", "DEFAULT_MAX_STAGING", "RING", "StreamBook", "chunk_pages"]

#: default bound on the host memory a capture stages (page files not yet consumed by the agent)
DEFAULT_MAX_STAGING = 256 << 20
#: default bytes of pages copied per engine step beyond the consistent point
DEFAULT_COPY_PER_STEP = 16 << 20
#: the fewest chunks the staging bound should hold: one the agent reads while the next is written
RING = 2


def chunk_pages(page_bytes: int, *, max_staging: int, copy_per_step: int) -> tuple[int, int]:
    """``(pages per chunk, chunks staged at most)``: a chunk is at most ``copy_per_step`` bytes,
    and the staged chunks (written, being written or not yet acknowledged) take at most half of
    ``max_staging`` — at least two of them where the bound allows, so the engine copies one while
    the agent reads another. The other half is for pages of read chunks still queued in the agent's
    save (:func:`agent.engines.staging.save_queue_bound`). A deeper ring hides the agent's round trip
    per chunk: under load that is tens of milliseconds, many engine steps."""
    page_bytes = max(1, page_bytes)
    half = max_staging // 2
    pages = max(1, min(copy_per_step // page_bytes, half // (RING * page_bytes)))
    return pages, max(1, half // (pages * page_bytes))


@dataclass(kw_only=True)
class StreamBook:
    """One capture in flight: the chunks issued, written (every rank's page file of a chunk),
    staged and acknowledged (every method runs under the adapter's lock). A subclass adds its
    pending pages and how it takes them."""

    #: whether chunk 0 is handed out through :attr:`complete` (vLLM's; SGLang answers the capture
    #: call with it directly)
    first_in_complete: ClassVar[bool] = True

    seq: int
    name: str
    directory: str
    info: dict[str, Any]  # the consistent point's facts: ledger, counts, timings
    chunk_pages: int
    page_bytes: int  # a stored page (every rank's heads together)
    max_staging: int
    ring: int = RING  # chunks staged at most (see chunk_pages)
    prefix_only: bool = False  # a pre-copy: no ledger, superseded by any real capture
    idle_timeout: float = 300.0
    waiters: list[Any] = field(default_factory=list)  # capture calls answered with chunk 0
    issued: int = 0  # chunks issued
    acked: set[int] = field(default_factory=set)
    complete: deque[int] = field(default_factory=deque)  # chunks written, not yet handed out
    chunk_pages_of: dict[int, int] = field(default_factory=dict)
    error: str | None = None
    last_chunk: int | None = None  # set once nothing is pending after a chunk is issued
    staged_bytes: int = 0
    peak_staged: int = 0
    copied_pages: int = 0
    max_copy_s: float = 0.0  # the longest a chunk's copy held up the engine
    touched: float = field(default_factory=time.monotonic)
    issued_at: dict[int, float] = field(default_factory=dict)
    latency: float = 0.0  # sum over chunks of issue → written
    written: int = 0  # chunks written (the mean latency's count)
    reports: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)  # chunk → rank → report
    reported: set[int] = field(default_factory=set)  # chunks every rank wrote

    def has_pending(self) -> bool:
        """Whether pages are left to issue (the subclass's pending pages)."""
        raise NotImplementedError

    def lost_pages(self) -> int:
        """Pages the stream had to do without (evicted before their turn)."""
        return 0

    def lost_since(self) -> list[str]:
        """The keys (hex) of pages lost since the last call: each reply part names its own."""
        return []

    # -- the engine's thread --

    def can_issue(self) -> bool:
        unacked = self.issued - len(self.acked)
        return self.error is None and self.last_chunk is None and unacked < self.ring

    def issue(self, pages: int, copy_s: float = 0.0) -> int:
        """Record chunk ``issued`` of ``pages`` pages (copied off the pools in ``copy_s``, where the
        copy is the caller's); returns its number. The last chunk is marked when nothing is left."""
        k = self.issued
        self.issued += 1
        self.chunk_pages_of[k] = pages
        self.issued_at[k] = time.monotonic()
        self.staged_bytes += pages * self.page_bytes
        self.peak_staged = max(self.peak_staged, self.staged_bytes)
        self.max_copy_s = max(self.max_copy_s, copy_s)
        if not self.has_pending():
            self.last_chunk = k
        return k

    def report(self, chunk: int, rank: int, rec: dict[str, Any], tp: int = 1) -> bool:
        """Rank ``rank``'s page file of chunk ``chunk`` is written (or failed: ``rec["error"]``);
        True when the chunk is complete (every one of the ``tp`` ranks' files) or failed."""
        got = self.reports.setdefault(chunk, {})
        got[rank] = rec
        if rec.get("error"):
            self.error = self.error or f"chunk {chunk}, rank {rank}: {rec['error']}"
            return True
        if len(got) < tp:
            return False
        self.reported.add(chunk)
        self.written += 1
        self.latency += time.monotonic() - self.issued_at.get(chunk, time.monotonic())
        self.copied_pages += self.chunk_pages_of.get(chunk, 0)
        self.max_copy_s = max(self.max_copy_s, max(float(d.get("copy_s", 0.0)) for d in got.values()))
        if chunk > 0 or self.first_in_complete:
            self.complete.append(chunk)
        return True

    # -- the control threads --

    @property
    def done(self) -> bool:
        """Every chunk up to the last acknowledged (chunks may complete out of order)."""
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

    def hand_out(self, chunk: int | None = None) -> dict[str, Any] | None:
        """A complete chunk (``chunk``, or the first to complete) as a reply part — every rank's
        page file, by rank — or None."""
        if chunk is not None:
            if chunk not in self.complete:
                return None
            self.complete.remove(chunk)
            k = chunk
        elif self.complete:
            k = self.complete.popleft()
        else:
            return None
        self.touched = time.monotonic()
        return {**self.part(k), "staged_peak_bytes": self.peak_staged}

    def part(self, k: int) -> dict[str, Any]:
        """Chunk ``k`` as a reply part: every rank's page file, by rank, and the pages lost since
        the last part."""
        shards = [dict(self.reports[k][r]) for r in sorted(self.reports[k])]
        return {"chunk": k, "shards": shards, "last": k == self.last_chunk, "lost": self.lost_since()}

    def files(self) -> list[str]:
        """Every page file of this stream (any rank's) that the agent has not acknowledged."""
        out = []
        for k, ranks in self.reports.items():
            if k not in self.acked:
                out += [str(r["index"]) for r in ranks.values() if r.get("index")]
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "chunks": self.issued,
            "copied_pages": self.copied_pages,
            "lost_pages": self.lost_pages(),
            "staged_peak_bytes": self.peak_staged,
            "max_staging_bytes": self.max_staging,
            "chunk_pages": self.chunk_pages,
            "ring": self.ring,
            "mean_chunk_latency_s": self.latency / max(1, self.written),
            "max_chunk_copy_s": self.max_copy_s,
        }
