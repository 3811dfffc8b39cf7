"""Whether a checkpoint restores warm into a worker, and why not: one verdict for the CLI's
``restore --dry-run``, the agent's ``GET /restore/plan`` and :func:`agent.session.restore`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from agent.engines import ledgers, shards
from agent.engines.types import TRUST_DOMAIN, Resubmission, WorkerDescription
from agent.session.worker import WorkerLike, describe, host_pins
from ckpt import Manifest, Pins, Policy, decide
from ckpt.compat import STRICT, RuleResult, rule_json

__all__ = ["Decision", "plan", "restore_decision"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether checkpoint ``checkpoint`` restores warm into a worker, and why not: the one
    verdict the CLI, the agent's API and :func:`agent.session.restore` give, serialized one way
    (:meth:`to_json`)."""

    checkpoint: str
    warm: bool
    reasons: list[str]
    results: list[RuleResult]
    policy: Policy
    requests: int
    blocks: int
    #: the requests that would not continue from the exact next token even on a warm restore,
    #: and why: the ledger's word, then this worker's (``LedgerFormat.judged_on``)
    inexact: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "warm": self.warm,
            "reasons": list(self.reasons),
            "requests": self.requests,
            "blocks": self.blocks,
            "inexact": {k: list(v) for k, v in self.inexact.items()},
            "results": [rule_json(r, self.policy) for r in self.results],
        }


def _shard_reasons(m: Manifest) -> list[str]:
    """Why the checkpoint's pages are not whole (a rank's part missing or inconsistent), naming the rank."""
    layout = m.layout
    recs = layout.get("shards")
    if recs is None:  # written before tensor parallelism was carried: one rank, whole pages
        return []
    try:
        # a stored page's head slots: the model's heads, or one per rank (vllm.groups.page_heads)
        total = int(layout.get("page_heads", layout["num_kv_heads"]))
        tp = int(layout.get("tensor_parallel_size", len(recs)))
        shards.check_cover(recs, total, tp)
        head_axis = int(layout.get("head_axis", 0))
        if int(layout["page_shape"][1 + head_axis]) != total:
            raise shards.ShardError(f"stored pages hold {layout['page_shape'][1 + head_axis]} of {total} KV heads")
    except (shards.ShardError, KeyError, TypeError, ValueError, IndexError) as exc:
        return [f"tensor parallel: {exc}"]
    return []


def _head_slot_reasons(theirs: Any, ours: Any) -> list[str]:
    """Why the checkpoint's stored pages map head slots to ranks otherwise than this worker's (the
    model's KV heads, or one slot per rank: ``layout.page_heads``, vllm.groups.page_heads). The
    pins alone do not tell them apart: a checkpoint written before page_heads existed of an MLA +
    linear-attention worker at TP > 1 has the pins of today's, and pages that hold rank 0's state
    alone."""
    a = theirs.get("page_heads") if isinstance(theirs, Mapping) else None
    b = ours.get("page_heads") if isinstance(ours, Mapping) else None
    if a == b:
        return []

    def slots(v: Any) -> str:
        return "one per KV head of the model" if v is None else f"{v}, one per rank"

    return [f"page heads: the checkpoint's pages hold head slots {slots(a)}; this worker's {slots(b)}"]


def restore_decision(
    m: Manifest,
    desc: WorkerDescription,
    policy: Policy | None = None,
    trust_domain: str | None = None,
    judged: list[Resubmission] | None = None,
) -> Decision:
    """The restore decision for checkpoint ``m`` and the worker ``desc`` describes, on this host:
    the pins' rules (:func:`ckpt.decide` under ``policy``), the block namespace, the trust domain
    and the TP shards. (The canary is judged by :func:`agent.session.restore`, on the worker.)

    With ``trust_domain``, a checkpoint taken in another domain is refused by name: its bytes came
    from workers this one does not trust. A checkpoint that names no domain (an older agent's) is
    allowed: those deduplicated across every worker of the repository (docs/agent.md).

    ``judged``: the ledger's requests as this worker judges them, where the caller has them
    (:func:`agent.session.restore`); read from the ledger otherwise."""
    policy = policy or STRICT
    decision = decide(m.pins, Pins(host=host_pins(desc), worker=desc.facts), policy)
    reasons = list(decision.reasons)
    fields = {k: v for k, v in m.namespace.items() if k != TRUST_DOMAIN}
    if fields != dict(desc.namespace_fields):
        reasons.append(f"namespace: checkpoint {fields} != worker {dict(desc.namespace_fields)}")
    theirs = m.namespace.get(TRUST_DOMAIN)
    if trust_domain is not None and theirs is not None and theirs != trust_domain:
        reasons.append(f"trust domain: checkpoint {theirs!r} != this worker's {trust_domain!r}")
    reasons += _shard_reasons(m)
    reasons += _head_slot_reasons(m.layout, desc.layout)
    # a KV cache group gpuckpt cannot carry (an SSM's state, say): the checkpoint has no pages,
    # or this worker could not load them — either way its requests replay cold, and say why
    for side, layout in (("checkpoint", m.layout), ("worker", desc.layout)):
        why = layout.get("kv_not_carried") if isinstance(layout, Mapping) else None
        if why:
            reasons.append(f"KV not carried ({side}): {why}")
    return Decision(
        m.id,
        not reasons,
        reasons,
        decision.results,
        policy,
        ledgers.request_count(m.ledger),
        m.sizes.blocks,
        _inexact(m, desc, judged),
    )


def _inexact(m: Manifest, desc: WorkerDescription, judged: list[Resubmission] | None) -> dict[str, list[str]]:
    """The checkpoint's requests that would not continue exactly on this worker, and why."""
    if judged is None:
        if m.ledger is None:
            return {}
        fmt = ledgers.format_of(m.ledger)
        judged = fmt.judged_on(fmt.resubmissions(m.ledger), desc.layout)
    return {r.request_id: list(r.reasons) for r in judged if not r.exact and r.left_to_client is None}


def plan(
    worker: WorkerLike, manifest: Manifest, policy: Policy | None = None, trust_domain: str | None = None
) -> Decision:
    """Would a restore of ``manifest`` into ``worker`` be warm, and why not; changes nothing
    (the worker is only asked to describe itself)."""
    return restore_decision(manifest, describe(worker), policy, trust_domain)
