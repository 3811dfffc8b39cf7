"""The engine-neutral interface between the agent (and ``ckpt``) and a serving engine.

An engine adapter (``agent.engines.vllm``, ``agent.engines.sglang``) lives
inside the serving process and answers three questions through these types;
nothing here imports an engine. :class:`Engine` is how the agent, its API
and the CLI reach a worker of either.

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

import abc
import hashlib
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ckpt import Block, Existing, Ledger, Manifest, Namespace, WorkerFacts

if TYPE_CHECKING:
    from agent.engines import serving
    from agent.engines.driver import Decision

__all__ = [
    "Capture",
    "Checkpointed",
    "Engine",
    "RestorePlan",
    "Resubmission",
    "ServingClient",
    "WorkerDescription",
]


#: the namespace field naming a checkpoint's trust domain (FORMAT.md §10: trust domains)
TRUST_DOMAIN = "trust_domain"


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
    ``api``: the API-level facts the worker's server recorded for the original
    request (endpoint, body and tenant digests), which let the restored
    worker hand the continuation to the client's retry; ``None`` when the
    request did not come through such a server.
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


def token_digest(token_ids: list[int] | tuple[int, ...]) -> str:
    """A token sequence's identity (SHA-256): what a restored request's state is matched on besides
    its id, and what a restore report keeps of an output instead of the tokens themselves."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()


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


@dataclass(frozen=True)
class Checkpointed:
    """A checkpoint taken: the visible manifest and what it cost (pause, copy, save; see
    :func:`agent.engines.driver.checkpoint`)."""

    manifest: Manifest
    stats: dict[str, Any]


class ServingClient(Protocol):
    """The worker's request API as the agent uses it: the canary probe and resubmission."""

    def wait_ready(self, timeout: float = ..., alive: Callable[[], bool] | None = ...) -> float: ...

    def generate(self, prompt_ids: list[int], n: int) -> list[int]:
        """Greedy: ``n`` new tokens after ``prompt_ids`` (the canary probe)."""
        ...

    def submit(self, requests: Iterable[Resubmission]) -> Mapping[str, serving.Completion]:
        """Each request under its original id, to completion; outputs by request id."""
        ...

    def close(self) -> None: ...


class Engine(abc.ABC):
    """A serving engine's worker, as the daemon, its API and the CLI reach it.

    The worker half (inside the serving process: vLLM's KV connector,
    SGLang's cache linker) answers gpuckpt's control protocol on
    ``socket`` (:mod:`agent.engines.control`) and exchanges pages through
    page files (:mod:`agent.engines.staging`), the same for every engine, so
    checkpointing, restore planning (pins, namespace, policy, canary,
    resubmission) and streaming are engine-neutral
    (:mod:`agent.engines.driver`) and written once. What an engine adds is
    how its worker is started (:meth:`worker_command`) and how requests get
    back into it (:meth:`client`); the ledger's layout is its own package's
    (:mod:`agent.engines.ledgers`). Get one with :func:`agent.engines.get`.
    """

    #: the name in ``engine = ...`` and in a worker's pins (``WorkerFacts.engine``)
    name: ClassVar[str]
    #: the port its API server listens on when the command names none
    default_port: ClassVar[int]

    def __init__(self, socket: str | os.PathLike[str], staging: Any = None) -> None:
        from agent.engines import driver

        self.socket = socket
        #: where the worker's page files may be and whom to trust with them (``driver.Staging``)
        self.staging = staging if staging is not None else driver.Staging()

    # -- the worker's half, over the control channel (engine-neutral) --

    def ping(self) -> int:
        """The worker process's pid (it answers: the adapter is loaded)."""
        from agent.engines import control

        return int(control.call(self.socket, "ping")["pid"])

    def describe(self) -> WorkerDescription:
        """The worker's pins, layout and namespace; :class:`ckpt.EngineMismatch` if it is another engine."""
        from agent.engines import driver

        return driver.describe(self.socket, self.name)

    def checkpoint(self, repo: Any, worker_id: str, **kw: Any) -> Checkpointed:
        """Capture and save (see :func:`agent.engines.driver.checkpoint` for the keywords)."""
        from agent.engines import driver

        stats: dict[str, Any] = {}
        m = driver.checkpoint(self.socket, repo, worker_id, where=self.staging, stats=stats, engine=self.name, **kw)
        return Checkpointed(m, stats)

    def precopy(self, repo: Any, **kw: Any) -> dict[str, Any]:
        """Store new cached pages ahead of the next checkpoint (:func:`agent.engines.driver.precopy`)."""
        from agent.engines import driver

        return driver.precopy(self.socket, repo, where=self.staging, engine=self.name, **kw)

    def plan(self, manifest: Manifest, policy: Any = None, trust_domain: str | None = None) -> Decision:
        """Would a restore of ``manifest`` into this worker be warm, and why not
        (:func:`agent.engines.driver.restore_decision`); changes nothing."""
        from agent.engines import driver

        return driver.restore_decision(manifest, self.describe(), policy, trust_domain)

    def restore(self, repo: Any, ref: str, **kw: Any) -> RestorePlan:
        """Plan and offer a restore (:func:`agent.engines.driver.restore`)."""
        from agent.engines import driver

        return driver.restore(repo, ref, self.socket, trust=self.staging.trust, engine=self.name, **kw)

    def withdraw(self) -> int:
        """End the worker's restore offer; returns the page files it held."""
        from agent.engines import driver

        return driver.withdraw(self.socket)

    def sweep(self) -> list[str]:
        """Delete capture page files nobody owns (a killed agent's), on the worker's side."""
        from agent.engines import driver

        return driver.sweep(self.socket)

    def stats(self) -> dict[str, Any]:
        """The worker half's counters (restored tokens per request, steps, offers)."""
        from agent.engines import driver

        return driver.stats(self.socket)

    # -- what differs by engine --

    @abc.abstractmethod
    def client(self, url: str) -> ServingClient:
        """A client of the worker's request API at ``url`` (canary probe, resubmission)."""

    @classmethod
    @abc.abstractmethod
    def runs(cls, command: list[str]) -> bool:
        """Whether ``command`` (``gpuckpt launch -- ...``) starts a worker of this engine."""

    @classmethod
    @abc.abstractmethod
    def worker_command(
        cls,
        command: list[str],
        *,
        control_socket: str,
        staging_dir: str | None,
        shared_group: str | None,
        hold_retries_s: float = 0.0,
    ) -> list[str]:
        """``command`` with this engine's gpuckpt adapter configured (its own flags, no patch).

        ``hold_retries_s``: a restore will follow; where the engine's server can, requests that
        may be retries (they carry an ``X-Request-Id``) wait up to this long for the agent to say
        which requests it resubmits, so that a retry attaches instead of starting a duplicate."""


def script_python(script: str) -> str:
    """The interpreter a console script runs with (its ``#!`` line; ours where it cannot be read)."""
    path = shutil.which(script)
    if path:
        with open(path, "rb") as f:
            first = f.readline().decode(errors="replace")
        if first.startswith("#!"):
            return shlex.split(first[2:].strip())[0]
    return sys.executable
