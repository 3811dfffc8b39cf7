"""Capture streams: one consistent point, then the immutable pages over the next steps.

The scheduler half's bookkeeping for one capture (no vLLM or torch import,
so it is tested on its own). Why a capture can be spread over steps:

- A *full* block in vLLM's prefix cache never changes while its block hash
  maps to it: vLLM writes only blocks a request is filling, and a cached
  block is taken for reuse only after its hash is dropped from the map (at
  allocation, in the scheduler, before the step's metadata is built). So a
  full block the map still names at step ``s``'s ``build_connector_meta`` is
  intact when the worker copies it in step ``s``'s ``wait_for_save`` — the
  same argument as a one-step capture, made again at every step.
- What can change is copied at the consistent point (chunk 0): the partial
  tails of live requests, the stored tails of finished ones, full blocks of
  live requests the map does not name, the seeded requests' sampler states,
  and the ledger.

The rest — the full blocks — is copied ``chunk_pages`` at a time, at most
``max_chunks`` chunks staged at once (the staging bound), oldest-at-risk
first (free cached blocks before blocks in use). A chunk is staged until the
agent acknowledges it (it has stored or at least consumed its pages): that
is the backpressure. A block evicted before its turn is *lost*: the
checkpoint does without it (the request or conversation that needed it
recomputes that part; nothing wrong is ever named).

A stream with no word from the agent for ``idle_timeout`` seconds is
abandoned (a killed agent): its staged chunks are deleted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.engines.streams import StreamBook


@dataclass
class CopyJob:
    """Scheduler → worker, in one step's metadata: copy these pages after the step's forward.

    Each rank writes its shard of the pages (and of the ``tails`` it keeps in
    memory) into the page file :meth:`file` names in ``directory`` and
    reports it under :attr:`job` in its worker metadata. ``generators``: also
    read the seeded requests' sampler states (the consistent point, chunk 0).
    ``before``: pages to copy *before* the step's forward (``handle_preemptions``), written with
    the others — a state group's running blocks, whose state after exactly the tokens computed
    so far the forward overwrites in place (chunk 0).
    """

    seq: int
    chunk: int
    directory: str
    name: str
    pages: list[tuple[str, int]]  # (key hex, block id)
    tails: list[str] = field(default_factory=list)  # finished requests' stored tails (key hex)
    generators: bool = False
    before: list[tuple[str, int]] = field(default_factory=list)  # (key hex, block id)

    @property
    def job(self) -> str:
        """The key of this chunk's reports: ``"<seq>.<chunk>"``."""
        return f"{self.seq}.{self.chunk}"

    def file(self, rank: int) -> str:
        return f"{self.name}-c{self.chunk}-r{rank}"


def parse_job(job: str) -> tuple[int, int]:
    """``(seq, chunk)`` of a :attr:`CopyJob.job` key."""
    seq, _, chunk = job.partition(".")
    return int(seq), int(chunk or 0)


@dataclass
class Pending:
    """A full block still to copy: its key, block id, and what to look up to see it is still there."""

    key: bytes
    block_id: int
    lookup: Any  # the block pool's map key (BlockHashWithGroupId)


@dataclass(kw_only=True)
class Stream(StreamBook):
    """One capture in flight (scheduler half; every method runs under the connector's lock)."""

    pending: deque[Pending]
    lost: list[bytes] = field(default_factory=list)
    lost_reported: int = 0

    def has_pending(self) -> bool:
        return bool(self.pending)

    def lost_pages(self) -> int:
        return len(self.lost)

    def lost_since(self) -> list[str]:
        new, self.lost_reported = self.lost[self.lost_reported :], len(self.lost)
        return [x.hex() for x in new]

    # -- the scheduler thread --

    def take(self, still_there: Callable[[Pending], bool]) -> list[Pending]:
        """The next chunk's pages: up to ``chunk_pages`` pending blocks that are still cached;
        the others are lost. Marks the stream's last chunk when nothing is left."""
        out: list[Pending] = []
        while self.pending and len(out) < self.chunk_pages:
            p = self.pending.popleft()
            if still_there(p):
                out.append(p)
            else:
                self.lost.append(p.key)
        return out

    def needs_steps(self) -> bool:
        """Whether the engine must keep stepping for this stream: a chunk to issue, or a chunk whose
        reports are still due (they come back only with a step's worker metadata)."""
        if self.error is not None:
            return False
        return self.can_issue() or len(self.reported) < self.issued
