"""The engine-neutral types between the agent (and ``ckpt``) and a serving engine's worker.

An engine adapter (``agent.engines.vllm``, ``agent.engines.sglang``) lives
inside the serving process and answers three questions through these types;
nothing here imports an engine.

1. *Who are you?* — :class:`WorkerDescription`: the worker's pins
   (:class:`ckpt.WorkerFacts`), its KV layout (a JSON-able dict stored in the
   manifest as ``layout``) and the namespace fields that scope its block keys.
2. *Give me a consistent snapshot.* — :class:`Capture`: the KV pages taken at
   one step boundary, as ready :class:`ckpt.Block` objects, plus the request
   ledger (``{"schema", "version", "data"}``, the shape of :class:`ckpt.Ledger`).
3. *Take this back.* — :class:`RestorePlan`: the verified blocks offered to
   the new worker as external cache hits, and the requests to resubmit.

Contracts:

* A content key names the bytes of a page within the namespace; a raw slot
  number is never a key. Two workers that give the same key in the same
  namespace must hold the same bytes.
* ``Capture.pages`` may be consumed once, and only before ``Capture.close``;
  it views staging memory that ``close`` frees.
* The ledger is plain JSON (no pickle): it is stored in the manifest and
  read by other processes and other versions.

The stats that cross layers (a capture's, a checkpoint's, a pre-copy's, a
restore's) are :class:`~typing.TypedDict` records: plain JSON objects at run
time, as reports and tests print them, with their keys and types stated here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from agent.fs import Trust
from ckpt import Block, Existing, Ledger, Manifest, Namespace, WorkerFacts

if TYPE_CHECKING:
    from agent.engines.serving import Completion

__all__ = [
    "TRUST_DOMAIN",
    "CanaryStats",
    "Capture",
    "CaptureStats",
    "CheckpointStats",
    "Checkpointed",
    "PrecopyStats",
    "RestStats",
    "RestTail",
    "RestorePlan",
    "RestoreStats",
    "Resubmission",
    "ServingClient",
    "Staging",
    "WorkerDescription",
    "token_digest",
]


#: the namespace field naming a checkpoint's trust domain (FORMAT.md §10: trust domains)
TRUST_DOMAIN = "trust_domain"


@dataclass(frozen=True)
class Staging:
    """Where a worker's page files may be, and who may own them: the staging directory the worker
    was configured with (``None``: any directory :func:`agent.fs.check_dir` accepts) and the
    accounts trusted with it (the shared group's, where worker and agent are two accounts)."""

    directory: str | os.PathLike[str] | None = None
    trust: Trust = dataclasses.field(default_factory=Trust.of)


@dataclass(frozen=True)
class WorkerDescription:
    """What a worker says about itself; recorded in the manifest and compared on restore."""

    facts: WorkerFacts
    layout: Mapping[str, Any]
    namespace_fields: Mapping[str, str]

    @property
    def namespace(self) -> Namespace:
        return Namespace(self.namespace_fields)

    def in_domain(self, trust_domain: str) -> Namespace:
        """The block namespace of this worker's checkpoints in ``trust_domain``: a block's key (its
        prefix hash, which the worker computes) names a blob only within the domain, so a worker
        can never make another domain's checkpoints deduplicate against bytes it chose."""
        return Namespace({**self.namespace_fields, TRUST_DOMAIN: trust_domain})


# -- stats -------------------------------------------------------------------------------------


class CaptureStats(TypedDict, total=False):
    """A capture's timings and counts: the worker's (at the consistent point) and the stream's
    (complete once ``Capture.pages`` is exhausted)."""

    # the worker's reply at the consistent point
    step: int
    pages: int  # once streamed: the pages copied and handed over
    prefix_pages: int
    tail_pages: int
    requests: int
    plan_s: float
    wait_s: float
    copy_s: float  # the engine's pause
    bytes: int
    write_s: float  # the worker's page-file write, off the engine's step
    capture_s: float  # to the consistent point's chunk
    page_shape: list[int]
    page_dtype: str
    layers: list[str]  # the layers' names, in the page files' order
    inexact_requests: int
    skipped_pages: int
    chunk_pages: int | None
    max_staging_bytes: int | None
    shards: list[dict[str, Any]]
    head_axis: int
    tensor_parallel_size: int
    # the stream's, once it ended
    chunks: int
    lost_pages: int
    staged_peak_bytes: int
    max_chunk_copy_s: float
    mean_chunk_latency_s: float
    stream_s: float


class CheckpointStats(CaptureStats, total=False):
    """A checkpoint's: its capture's, plus the save's and the canary's."""

    save_s: float
    canary_s: float
    recaptured: int  # keys taken for durable the repository no longer held (captured again)


class PrecopyStats(TypedDict, total=False):
    """A pre-copy's: what the repository stored (:meth:`ckpt.Repository.store_blocks`) and the stream's."""

    blocks: int
    new_blocks: int
    new_raw_bytes: int
    packs_written: int
    lost_pages: int | None
    chunks: int | None
    staged_peak_bytes: int | None
    total_s: float


class CanaryStats(TypedDict, total=False):
    """The restore's canary probe: run or not, and what it saw."""

    checked: bool
    recorded: bool  # when not checked: whether the checkpoint has a probe at all
    match: bool
    expected: list[int]
    got: list[int]
    canary_s: float
    on_restored_pages: bool


class RestoreStats(TypedDict, total=False):
    """A restore's first part: where its time went and what was offered."""

    phases: dict[str, float]  # manifest_s, describe_s, keys_s, fetch_s
    generators: int
    blocks: int
    first_blocks: int
    failed_blocks: int
    failures: list[str]
    first_s: float
    canary: CanaryStats
    withdrawn: int  # a failed probe: the blocks offered and then withdrawn
    release: str  # "each" | "together"
    plan_s: float
    request_states: int  # a cold plan: the request states offered alone


class RestStats(TypedDict, total=False):
    """The rest of a streaming restore, behind its first part."""

    blocks: int
    failed_blocks: int
    failures: list[str]
    parts: int
    not_offered: int  # past the restore's staging bound
    inflight_blocks: int
    inflight_parts: int
    wanted_blocks: int  # offered ahead of their turn because a request asked for them
    first_request_s: float
    inflight_s: float
    rest_wait: str
    rest_waited_s: float
    ended: str  # the offer ended (withdrawn, expired) or the worker refused a part
    error: str
    rest_s: float


# -- what a checkpoint and a restore hand back ---------------------------------------------------


@dataclass
class Capture:
    """One consistent snapshot: the ledger of one step boundary and the pages as of that boundary.

    ``pages`` yields blocks in no particular order (an engine may stream them
    after the boundary: see :func:`agent.session.capture`); keys are unique
    within a capture; ``stats`` is complete once ``pages`` is exhausted.
    ``close`` frees the staging memory and is idempotent.
    """

    pages: Iterator[Block | Existing]  # Existing: durable keys an incremental capture did not copy
    ledger: Ledger | None  # None for a pre-copy (prefix cache only)
    stats: CaptureStats = field(default_factory=lambda: CaptureStats())
    close: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class Checkpointed:
    """A checkpoint taken: the visible manifest and what it cost (pause, copy, save; see
    :func:`agent.session.checkpoint`)."""

    manifest: Manifest
    stats: CheckpointStats


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
    ``api``: the API-level facts the worker's server recorded for the original
    request (endpoint, body and tenant digests), which let the restored
    worker hand the continuation to the client's retry; ``None`` when the
    request did not come through such a server. ``left_to_client``: the
    request is not resubmitted (see the field).
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
    api: dict[str, Any] | None = None
    #: not to be resubmitted at all: the ledger could not carry its input (prompt embeddings,
    #: images; why). Its client's retry sends the whole input again and is served as new.
    left_to_client: str | None = None
    #: what the continuation needs of the restoring worker beyond its tokens, in its engine's words
    #: (vLLM: ``{"grammar": the structured-output settings its grammar was compiled under}``), which
    #: the engine's ``judged_on`` holds against the worker's layout; never sent to the worker
    needs: dict[str, Any] | None = None
    #: the logprobs of ``output_token_ids`` as the checkpoint carried them (one position per token,
    #: :func:`agent.engines.continuations.encode_position`): handed to the worker's server with
    #: the resubmission, so that a retry asking for logprobs is served them whole
    logprobs: list[Any] | None = None
    #: the request's original budget as sampling fields (vLLM: ``max_tokens``, ``min_tokens``; a
    #: ``None`` value: the field was not given), which a recomputation from its prompt puts back
    #: (:meth:`from_prompt`); ``None``: the ledger does not say
    budget: dict[str, Any] | None = None

    def from_prompt(self) -> Resubmission:
        """This request as it is resubmitted when it cannot continue exactly (``reasons``): computed
        again from its original prompt under its own parameters — its seed, penalties, grammar,
        budget, from their start — never continued from its earlier outputs without a state they
        need, so that whoever is served it (its client's retry, attached) gets an answer an
        uninterrupted worker gives. Its prompt's pages are still restored. Without its budget
        (the ledger does not say it) it is left to its client. Unchanged: a request that is
        exact, left already, or has no earlier outputs."""
        if self.exact or self.left_to_client is not None or not self.output_token_ids:
            return self
        if self.budget is None:
            return Resubmission.left(
                self.request_id, f"it cannot continue exactly ({'; '.join(self.reasons)})", self.api
            )
        sampling = {**self.sampling, **self.budget}
        for k, v in self.budget.items():
            if v is None:
                del sampling[k]
        return dataclasses.replace(
            self,
            token_ids=self.token_ids[: self.num_prompt_tokens],
            output_token_ids=[],
            sampling=sampling,
            needs=None,
            logprobs=None,
            reasons=(*self.reasons, RECOMPUTED),
        )

    @classmethod
    def left(cls, request_id: str, why: str, api: dict[str, Any] | None = None) -> Resubmission:
        """A request of the checkpoint that is not resubmitted: its input is not in the ledger (why)."""
        why = why[:200] or "its input is not carried by the ledger"
        return cls(
            request_id=request_id,
            token_ids=[],
            num_prompt_tokens=0,
            output_token_ids=[],
            sampling={},
            exact=False,
            reasons=(f"left to its client: {why}",),
            api=api,
            left_to_client=why,
        )


#: the last of the reasons of a request that is computed again from its prompt (:meth:`Resubmission.from_prompt`)
RECOMPUTED = "recomputed from its prompt: not continued from its earlier outputs without what they need"


def token_digest(token_ids: list[int] | tuple[int, ...]) -> str:
    """A token sequence's identity (SHA-256): what a restored request's state is matched on besides
    its id, and what a restore report keeps of an output instead of the tokens themselves."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()


class RestTail(Protocol):
    """The rest of a streaming restore, offered behind its first part on a thread of its own
    (:class:`agent.session.restore_rest.RestoreRest`)."""

    #: blocks the worker took so far
    offered: int
    stats: RestStats
    #: set once every in-flight request's pages are offered (or failed)
    inflight_done: threading.Event

    def wait(self, timeout: float | None = None) -> bool: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class RestorePlan:
    """What a restore hands the new worker: warm or not (and why), and the requests to resubmit."""

    warm: bool
    reasons: list[str]
    requests: list[Resubmission]
    blocks_offered: int = 0
    stats: RestoreStats = field(default_factory=lambda: RestoreStats())
    #: a streaming restore's rest, offered behind the in-flight requests' blocks; None when nothing follows
    rest: RestTail | None = None

    def wait_offered(self, timeout: float | None = None) -> bool:
        """Wait until every block the restore will offer is offered (or failed); False on timeout."""
        return self.rest is None or bool(self.rest.wait(timeout))

    def totals(self) -> dict[str, Any]:
        """Blocks written and failed over the whole restore so far, the rest's parts included."""
        rest: RestStats = self.rest.stats if self.rest is not None else RestStats()
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

    def inexact(self) -> dict[str, list[str]]:
        """Why each request that is not continued exactly is replayed cold, by request id (those
        left to their clients are not replayed at all: :meth:`left_to_client`)."""
        return {r.request_id: list(r.reasons) for r in self.requests if not r.exact and r.left_to_client is None}

    def left_to_client(self) -> dict[str, str]:
        """The checkpoint's requests that are not resubmitted (their input is not in the ledger), and why."""
        return {r.request_id: r.left_to_client for r in self.requests if r.left_to_client is not None}

    def to_resubmit(self) -> list[Resubmission]:
        """The requests a resubmission sends."""
        return [r for r in self.requests if r.left_to_client is None]


class ServingClient(Protocol):
    """The worker's request API as the agent uses it: the canary probe and resubmission."""

    def wait_ready(self, timeout: float = ..., alive: Callable[[], bool] | None = ...) -> float: ...

    def generate(self, prompt_ids: list[int], n: int) -> list[int]:
        """Greedy: ``n`` new tokens after ``prompt_ids`` (the canary probe)."""
        ...

    def submit(
        self, requests: Iterable[Resubmission], *, stream: bool = ..., on_done: Callable[[str], None] | None = ...
    ) -> Mapping[str, Completion]:
        """Each request under its original id, to completion; outputs by request id (``stream``:
        whether the server streams them back; each client has its own default; ``on_done``: told
        each request id as its completion comes back — not one that failed)."""
        ...

    def close(self) -> None: ...
