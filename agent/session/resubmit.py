"""Resubmission: a restore's requests sent back into the new worker, and what came of each.

The daemon (restore at start: :mod:`agent.daemon.restore_at_start`) and the
CLI (``gpuckpt restore``) both restore with :func:`agent.session.restore`
and resubmit with :func:`resubmit`, and both read the same typed result
(:class:`Resubmitted`, one :class:`Continuation` per request); each serves
the view it always has: the daemon's bounded per-request summaries
(:meth:`Continuation.summary`: lengths and digests, never tokens) and the
CLI's outputs (:meth:`Continuation.output`, in :meth:`Restored.to_json`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.engines.serving import Completion
from agent.engines.types import RECOMPUTED, RestorePlan, Resubmission, ServingClient, token_digest
from agent.session.worker import WorkerLike, channel_of

__all__ = ["Continuation", "Restored", "Resubmitted", "resubmit", "unapplied_states"]

log = logging.getLogger("gpuckpt.session")


@dataclass(frozen=True)
class Continuation:
    """One resubmitted request and its completion; ``reasons``: why it is not an exact
    continuation (the restore's word on the request, then the worker's on its carried state)."""

    request: Resubmission
    completion: Completion
    reasons: tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        return not self.reasons

    @property
    def output_token_ids(self) -> list[int]:
        """The request's whole output: before the checkpoint, then the continuation's."""
        return self.request.output_token_ids + self.completion.token_ids

    def summary(self) -> dict[str, Any]:
        """Its bounded summary (lengths and a digest, not the tokens: the worker keeps those for
        the client's retry), as the agent's ``GET /restore`` serves it."""
        whole = self.output_token_ids
        out = self.completion
        return {
            "output_tokens": len(whole),
            "output_digest": token_digest(whole),
            "new_tokens": len(out.token_ids),
            "finish_reason": out.finish_reason,
            "cached_tokens": out.cached_tokens,
            "prompt_tokens": len(self.request.token_ids),
            "exact": self.exact,
            "reasons": list(self.reasons),
            "left_to_client": out.left_to_client,
        }

    def output(self) -> dict[str, Any]:
        """The continuation itself, as ``gpuckpt restore --json`` prints it."""
        c = self.completion
        return {"new_token_ids": c.token_ids, "finish_reason": c.finish_reason, "cached_tokens": c.cached_tokens}


@dataclass(frozen=True)
class Resubmitted:
    """What the worker made of a restore's requests: one :class:`Continuation` each, in the
    requests' order, and the completions as the client returned them."""

    continuations: tuple[Continuation, ...]
    completions: Mapping[str, Completion] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.continuations)

    def summaries(self) -> dict[str, dict[str, Any]]:
        """Each request's :meth:`Continuation.summary`, by request id."""
        return {c.request.request_id: c.summary() for c in self.continuations}

    def outputs(self) -> dict[str, dict[str, Any]]:
        """Each completion's :meth:`Continuation.output`, by request id, in the client's order."""
        by_id = {c.request.request_id: c for c in self.continuations}
        return {rid: by_id[rid].output() for rid in self.completions if rid in by_id}

    def newly_inexact(self) -> dict[str, list[str]]:
        """Requests the restore planned as exact that the worker's word made cold replays."""
        return {c.request.request_id: list(c.reasons) for c in self.continuations if c.reasons and c.request.exact}

    def left_to_client(self) -> dict[str, str]:
        """Requests not resubmitted (their client's retry computes them), and why."""
        return {
            c.request.request_id: c.completion.left_to_client for c in self.continuations if c.completion.left_to_client
        }


def unapplied_states(worker: WorkerLike) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The worker's word on the carried states, by ledger id: those no request claimed (it
    replayed cold) and, apart, those it could not apply — whose continuation it voided, so that no
    client is served a continuation that ignored them (their retries are served anew: left to
    their clients). Empty when the worker cannot say (it may be gone: nothing to add, and that is
    logged)."""
    try:
        st = channel_of(worker).stats()
    except Exception as exc:
        log.warning("could not ask the worker which request states were applied", extra={"error": str(exc)})
        return {}, {}
    out: dict[str, list[str]] = {}
    for cid in st.get("states_waiting") or ():
        why = (st.get("states_refused") or {}).get(cid)
        out[cid] = [f"its carried state was never applied{f' ({why})' if why else ''}: replayed cold"]
    voided = {str(k): str(v) for k, v in (st.get("states_voided") or {}).items()}
    for cid, applied in (st.get("states_applied") or {}).items():
        for a in applied:
            if "failed" in str(a) and cid not in voided:
                out.setdefault(cid, []).append(f"{a}: replayed cold")
    return out, voided


def resubmit(
    client: ServingClient,
    requests: Sequence[Resubmission],
    *,
    stream: bool | None = None,
    worker: WorkerLike | None = None,
    on_done: Callable[[str], None] | None = None,
) -> Resubmitted:
    """Submit ``requests`` to the worker's API, each under its original id, to completion.

    ``stream``: whether the server streams each answer back (None: the
    client's default); the daemon asks for one response per request (nobody
    watches its streams: the clients' retries do). With ``worker``, a request
    whose carried state the worker never applied is reported a cold replay, and one whose state
    it could not apply is left to its client, the continuation dropped
    (:func:`unapplied_states`). A request that cannot continue exactly (``reasons``: a state its
    earlier outputs need cannot be had here) is computed again from its prompt instead
    (:meth:`Resubmission.from_prompt`): whoever is served it gets an answer an uninterrupted
    worker gives. The client's errors propagate.
    """
    requests = [r.from_prompt() for r in requests]
    kw: dict[str, Any] = {} if stream is None else {"stream": stream}
    if on_done is not None:
        kw["on_done"] = on_done
    outs = dict(client.submit(requests, **kw))
    unapplied, voided = unapplied_states(worker) if worker is not None else ({}, {})
    for rid, why in voided.items():
        if rid in outs:  # the continuation was dropped: its client's retry computes the request anew
            outs[rid] = Completion(rid, left_to_client=f"its continuation was dropped: {why}")
    # a request computed again from its prompt claims none of its states (they were its earlier outputs')
    conts = tuple(
        Continuation(
            r, outs[r.request_id], (*r.reasons, *([] if RECOMPUTED in r.reasons else unapplied.get(r.request_id, [])))
        )
        for r in requests
    )
    return Resubmitted(conts, outs)


@dataclass(frozen=True)
class Restored:
    """A restore and its resubmission, as ``gpuckpt restore`` reports them (:meth:`to_json`)."""

    checkpoint: str
    plan: RestorePlan
    resubmitted: Resubmitted | None = None

    def outputs(self) -> dict[str, dict[str, Any]]:
        return self.resubmitted.outputs() if self.resubmitted is not None else {}

    def inexact(self) -> dict[str, list[str]]:
        """Each resubmitted request that is not an exact continuation, and why: the restore's word
        (the ledger's, judged on this worker) and, once resubmitted, the worker's."""
        out = self.plan.inexact()
        if self.resubmitted is not None:
            out.update(self.resubmitted.newly_inexact())  # requests the plan held exact
        return out

    def to_json(self) -> dict[str, Any]:
        outputs = self.outputs()
        return {
            "checkpoint": self.checkpoint,
            "warm": self.plan.warm,
            "reasons": self.plan.reasons,
            "inexact": self.inexact(),
            "blocks_offered": self.plan.offered_total,
            "requests": [x.request_id for x in self.plan.requests],
            "resubmitted": bool(outputs),
            "outputs": outputs,
            "stats": self.plan.stats,
        }
