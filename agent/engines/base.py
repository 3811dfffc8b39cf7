"""The engine-neutral interface between the agent (and ``ckpt``) and a serving engine.

An engine adapter (``agent.engines.vllm``, later an SGLang sibling) lives
inside the serving process and answers three questions through these types;
nothing here imports an engine.

1. *Who are you?* — :class:`WorkerDescription`: the worker's pins
   (:class:`ckpt.WorkerFacts`), its KV layout (a JSON-able dict stored in the
   manifest as ``layout``) and the namespace fields that scope its block keys.
2. *Give me a consistent snapshot.* — :class:`Capture`: the KV pages taken at
   one step boundary, as ``(content key, page)`` pairs or ready
   :class:`ckpt.Block` objects, plus the request ledger
   (``{"schema", "version", "data"}``, the shape of :class:`ckpt.Ledger`).
3. *Take this back.* — :class:`RestorePlan`: the verified blocks to offer the
   new worker as external cache hits, and the requests to resubmit.

Contracts:

* A content key names the bytes of a page within the namespace; a raw slot
  number is never a key. Two workers that give the same key in the same
  namespace must hold the same bytes.
* ``Capture.pages`` may be consumed once, and only before ``Capture.close``;
  it views staging memory that ``close`` frees.
* The ledger is plain JSON (no pickle): it is stored in the manifest and
  read by other processes and other versions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckpt import Block, Existing, Ledger, Namespace, WorkerFacts

__all__ = ["Capture", "Engine", "Resubmission", "RestorePlan", "WorkerDescription"]


@dataclass(frozen=True)
class WorkerDescription:
    """What a worker says about itself; recorded in the manifest and compared on restore."""

    facts: WorkerFacts
    layout: Mapping[str, Any]
    namespace_fields: Mapping[str, str]

    @property
    def namespace(self) -> Namespace:
        return Namespace(self.namespace_fields)


@dataclass
class Capture:
    """One consistent snapshot: the ledger of one step boundary and the pages as of that boundary.

    ``pages`` yields blocks in no particular order (an engine may stream them
    after the boundary: see the vLLM driver's ``capture``); keys are unique
    within a capture; ``stats`` is complete once ``pages`` is exhausted.
    ``close`` frees the staging memory and is idempotent.
    """

    pages: Iterator[Block | Existing]  # Existing: durable keys an incremental capture did not copy
    ledger: Ledger | None  # None for a pre-copy (prefix cache only)
    stats: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class Resubmission:
    """One in-flight request to submit again after a restore (warm or cold).

    ``token_ids`` is the prompt followed by the outputs produced before the
    checkpoint; ``sampling`` carries the original parameters (JSON) with the
    budget already reduced by those outputs. ``output_token_ids`` are the
    outputs so far, so a caller can present prior + new outputs under
    ``request_id`` (the client's original id). ``exact`` is false when the
    request cannot continue from the exact next token (``reasons`` say why):
    it is then a cold replay of that request, whatever the plan's warmth.
    ``sampling`` may hold ``structured_outputs`` (the constraint, as JSON).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    output_token_ids: list[int]
    sampling: dict[str, Any]
    priority: int = 0
    cache_salt: str | None = None
    exact: bool = True
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class RestorePlan:
    """What a restore hands the new worker: warm or not (and why), and the requests to resubmit."""

    warm: bool
    reasons: list[str]
    requests: list[Resubmission]
    blocks_offered: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    #: a streaming restore's rest, offered behind the in-flight requests' blocks (``wait(timeout)``,
    #: ``offered``, ``stats``); None when nothing follows
    rest: Any = None

    def wait_offered(self, timeout: float | None = None) -> bool:
        """Wait until every block the restore will offer is offered (or failed); False on timeout."""
        return self.rest is None or bool(self.rest.wait(timeout))

    def totals(self) -> dict[str, Any]:
        """Blocks written and failed over the whole restore so far, the rest's parts included."""
        rest = self.rest.stats if self.rest is not None else {}
        return {
            "blocks": int(self.stats.get("blocks", 0)) + int(rest.get("blocks", 0)),
            "failed_blocks": int(self.stats.get("failed_blocks", 0)) + int(rest.get("failed_blocks", 0)),
            "failures": list(self.stats.get("failures", [])) + list(rest.get("failures", [])),
            "not_offered": int(rest.get("not_offered", 0)),
        }

    @property
    def offered_total(self) -> int:
        """Blocks offered so far: the first part and what of the rest has followed."""
        return self.blocks_offered + (int(self.rest.offered) if self.rest is not None else 0)


class Engine(Protocol):
    """The calls the agent makes on a running worker (over the adapter's control channel)."""

    def describe(self) -> WorkerDescription: ...

    def capture(self, timeout: float = ...) -> Capture: ...

    def offer(self, blocks: Iterable[Block]) -> int:
        """Make ``blocks`` available as external cache hits; returns how many were accepted."""
        ...
