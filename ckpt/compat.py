"""Compatibility rules: may this checkpoint be loaded warm here?

Each pinned fact (see :mod:`ckpt.pins`) has a :class:`Rule` named exactly like
the field. :func:`check` runs every rule and gives a :class:`RuleResult` per
rule with a :class:`Verdict`:

- ``match``: both sides hold the same value (two ABSENT values match);
- ``mismatch``: the values differ (ABSENT against a value included);
- ``unknown``: either side is ``None`` (not recorded, or not determinable
  here), or the rule itself failed.

:func:`decide` applies a :class:`Policy`. The strict default refuses a warm
restore on any mismatch or unknown: nothing is ever loaded on a guess. A
policy may *ignore* rules (their verdict is disregarded) or *allow unknown*
for rules (UNKNOWN accepted, MISMATCH still refuses). A refusal names every
refusing rule and both values, and means a cold start with ledger replay.

Rules live in the :data:`RULES` registry; :func:`register` adds one.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from ckpt.errors import ConfigError, IncompatibleCheckpoint
from ckpt.pins import ABSENT, FactValue, HostFacts, Pins, WorkerFacts

__all__ = [
    "rule_json",
    "RULES",
    "STRICT",
    "Decision",
    "Policy",
    "Rule",
    "RuleResult",
    "Verdict",
    "check",
    "decide",
    "equality",
    "register",
]

log = logging.getLogger(__name__)


class Verdict(StrEnum):
    """The outcome of one rule."""

    MATCH = "match"
    MISMATCH = "mismatch"
    UNKNOWN = "unknown"


Comparator = Callable[[FactValue, FactValue], tuple[Verdict, str]]
"""``compare(recorded, current) -> (verdict, detail)``; must not raise."""


def _show(value: FactValue) -> str:
    if value is None:
        return "unknown"
    if value == "":
        return '""'
    return str(value)


@dataclass(frozen=True)
class RuleResult:
    """One rule's verdict, with the value recorded in the checkpoint and the current one."""

    rule: str
    verdict: Verdict
    recorded: FactValue
    current: FactValue
    detail: str = ""

    @property
    def line(self) -> str:
        """One human line, naming the rule, its verdict and both values.

        e.g. ``driver_version: mismatch (checkpoint 550.54.15, here 560.35.03)``;
        ``None`` shows as ``unknown``. A mismatch whose rule says more than that the values
        differ says it after them (``kv_groups: mismatch (…): KV cache group 1: …``).
        """
        line = f"{self.rule}: {self.verdict} (checkpoint {_show(self.recorded)}, here {_show(self.current)})"
        if self.verdict is Verdict.MISMATCH and self.detail not in ("", _DIFFER):
            line += f": {self.detail}"
        return line

    def __str__(self) -> str:
        return self.line


def equality(recorded: FactValue, current: FactValue) -> tuple[Verdict, str]:
    """The default comparison.

    ``None`` on either side is UNKNOWN; otherwise equal values (ABSENT and
    ABSENT included) MATCH and anything else is a MISMATCH.
    """
    if recorded is None and current is None:
        return Verdict.UNKNOWN, "unknown in the checkpoint and here"
    if recorded is None:
        return Verdict.UNKNOWN, "not recorded in the checkpoint"
    if current is None:
        return Verdict.UNKNOWN, "could not be determined here"
    if recorded == current:
        return Verdict.MATCH, ""
    return Verdict.MISMATCH, _DIFFER


#: the detail of a plain mismatch (:func:`equality`), which a reason line leaves out
_DIFFER: Final = "values differ"


@dataclass(frozen=True)
class Rule:
    """A named compatibility rule.

    ``extract`` reads the fact from a :class:`~ckpt.pins.Pins`; ``compare``
    judges the recorded value against the current one. ``scope``, where set, says why the fact
    does not bear on the bytes for this pair of pins (``None``: it does): the fact is then
    recorded, not compared (MATCH, with that reason as the detail).
    """

    name: str
    description: str
    extract: Callable[[Pins], FactValue]
    compare: Comparator = equality
    scope: Callable[[Pins, Pins], str | None] | None = None

    def evaluate(self, recorded: Pins, current: Pins) -> RuleResult:
        """Run the rule. A rule that raises gives UNKNOWN (which refuses by default)."""
        old: FactValue = None
        new: FactValue = None
        try:
            old = self.extract(recorded)
            new = self.extract(current)
            if self.scope is not None and (why := self.scope(recorded, current)) is not None:
                return RuleResult(self.name, Verdict.MATCH, old, new, f"recorded, not compared: {why}")
            verdict, detail = self.compare(old, new)
        except Exception as exc:
            log.warning("compatibility rule %s failed", self.name, exc_info=True)
            return RuleResult(self.name, Verdict.UNKNOWN, old, new, f"rule failed: {exc!r}")
        return RuleResult(self.name, Verdict(verdict), old, new, detail)


RULES: dict[str, Rule] = {}
"""Every rule :func:`check` runs, by name, in the order they were registered."""


def register(rule: Rule) -> Rule:
    """Add a rule to :data:`RULES`. Raises :class:`ValueError` if the name is taken."""
    if rule.name in RULES:
        raise ValueError(f"a compatibility rule named {rule.name!r} is already registered")
    RULES[rule.name] = rule
    return rule


def _host(name: str) -> Callable[[Pins], FactValue]:
    def extract(pins: Pins) -> FactValue:
        value: FactValue = getattr(pins.host, name)
        return value

    return extract


def _worker(name: str) -> Callable[[Pins], FactValue]:
    def extract(pins: Pins) -> FactValue:
        value: FactValue = getattr(pins.worker, name)
        return value

    return extract


# Why each fact is pinned. Every fact compares by equality.
_HOST_RULES: Final[Mapping[str, str]] = {
    "gpu_product": "GPU product: kernels and KV page layout are tuned per GPU.",
    "gpu_compute_capability": "GPU compute capability: kernels and fp8 formats depend on it.",
    "gpu_count": (
        "Number of GPUs on the host. Recorded, not compared: a page does not depend on how many GPUs "
        "the node has (fleets mix 1-, 4- and 8-GPU nodes), and the worker's own GPUs are its "
        "tensor-parallel size, which reshards."
    ),
    "driver_version": "NVIDIA kernel driver version.",
    "cuda_driver_version": "CUDA version the driver supports.",
    "cuda_runtime_version": "CUDA runtime of the engine's torch.",
    "cpu_isa": (
        "CPU instruction-set level: the CPU backend's page format depends on it. Compared for CPU "
        "workers only: a GPU worker's pages and sampler state do not depend on its host's CPU."
    ),
    "cpu_arch": "CPU architecture.",
    "torch_version": "torch version.",
}
_WORKER_RULES: Final[Mapping[str, str]] = {
    "engine": "Serving engine name.",
    "engine_version": "Serving engine version: block hashing and layouts change between versions.",
    "attention_backend": "Attention backend: it decides the KV memory layout.",
    "kv_layout": "Shape and order of the KV cache tensors.",
    "block_size": "Tokens per KV block.",
    "kv_dtype": "Element type of the KV cache.",
    "num_kv_heads": (
        "KV heads of the model in all: a stored page holds every one of them (or one slot per rank, "
        "layout.page_heads, where a state group runs at TP above them)."
    ),
    "head_size": "Elements per head and token: the bytes of one head's slice of a page.",
    "model_runner": "Model runner: what a request's carried sampler state means.",
    "tensor_parallel_size": (
        "Tensor-parallel size. Recorded, not compared: stored pages hold every KV head, "
        "and each rank of the restoring worker loads its own (resharding). A state-space group's "
        "pages do not reshard: kv_groups names its size (and page_heads, one slot per rank, "
        "is compared with the worker's layout by a restore, not by these pins)."
    ),
    "pipeline_parallel_size": "Pipeline-parallel size: each stage holds a slice of the layers.",
    "rank": "The rank that described the worker. Recorded, not compared (see tensor_parallel_size).",
    "model": (
        "Model path or name as given to the engine. Advisory: the same model may live "
        "at different paths, and a path may hold different weights; model_digest is "
        "what proves identity (ignore this rule when paths differ between hosts)."
    ),
    "model_revision": "Model revision (e.g. a Hugging Face commit).",
    "model_digest": "sha256 over the model's config and weight files: the model's identity.",
    "tokenizer_digest": "sha256 over the tokenizer files: token ids must mean the same.",
    "prefix_hash_algo": "Prefix-cache hash algorithm: block keys must be computed the same way.",
    "prefix_hash_seed": "Seed of the prefix hash chain: block keys must be computed the same way.",
    "kv_groups": (
        "KV cache groups (full attention, sliding window, ...), compared group by group: a page "
        "belongs to its group, and a group keeps only the blocks its kind attends to. A state-space "
        "group at tensor parallel size > 1 names that size (mamba@tp2): its pages hold each rank's "
        "own state heads and restore onto the same size only."
    ),
}

#: what a missing ``kv_groups`` means: one full-attention group (see :class:`ckpt.pins.WorkerFacts`)
LEGACY_KV_GROUPS: Final = "full"


def kv_groups(recorded: FactValue, current: FactValue) -> tuple[Verdict, str]:
    """Group by group, naming the first group that differs; ``None`` is one full-attention group
    (every checkpoint before hybrid groups, and an engine that does not report its groups)."""
    a = str(recorded if recorded is not None else LEGACY_KV_GROUPS).split(";")
    b = str(current if current is not None else LEGACY_KV_GROUPS).split(";")
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else "(none)"
        y = b[i] if i < len(b) else "(none)"
        if x != y:
            x, y = (re.sub(r"^g\d+=", "", v) for v in (x, y))
            tx, ty = (_state_tp(v) for v in (x, y))
            if tx != ty and _STATE_TP.sub("", x) == _STATE_TP.sub("", y):
                return Verdict.MISMATCH, (
                    f"KV cache group {i} ({_STATE_TP.sub('', x).split('/')[0]}): its state is split between ranks "
                    f"by the model's own state heads and restores onto the same tensor parallel size only "
                    f"(checkpoint {tx}, here {ty})"
                )
            return Verdict.MISMATCH, f"KV cache group {i}: checkpoint {x}, here {y}"
    return Verdict.MATCH, ""


#: a state group's tensor parallel size in a ``kv_groups`` signature (``mamba@tp2/2``)
_STATE_TP: Final = re.compile(r"@tp(\d+)")


def _state_tp(group: str) -> int:
    m = _STATE_TP.search(group)
    return int(m.group(1)) if m else 1


def recorded_only(recorded: FactValue, current: FactValue) -> tuple[Verdict, str]:
    """For facts kept for the record that a restore adapts to (tensor-parallel size and rank)."""
    if recorded == current:
        return Verdict.MATCH, ""
    return Verdict.MATCH, "differs; pages are resharded on restore"


def host_gpu_count(recorded: FactValue, current: FactValue) -> tuple[Verdict, str]:
    """The host's GPU count is kept for the record: a node's shape is not the worker's."""
    if recorded == current:
        return Verdict.MATCH, ""
    return Verdict.MATCH, "differs; recorded, not compared: the worker's pages do not depend on the node's GPU count"


def _gpu_worker(pins: Pins) -> bool:
    """Whether the pins are a GPU worker's: a GPU on the host and a CUDA build of torch."""
    h = pins.host
    return all(v not in (None, ABSENT) for v in (h.gpu_product, h.cuda_runtime_version))


def gpu_workers(recorded: Pins, current: Pins) -> str | None:
    """Why the host CPU does not bear on the bytes: both sides are GPU workers (``None``: it does)."""
    if _gpu_worker(recorded) and _gpu_worker(current):
        return "GPU workers on both sides; their pages do not depend on the host CPU"
    return None


for _name, _description in _HOST_RULES.items():
    register(
        Rule(
            _name,
            _description,
            _host(_name),
            host_gpu_count if _name == "gpu_count" else equality,
            gpu_workers if _name == "cpu_isa" else None,
        )
    )


_RECORDED_ONLY: Final = frozenset({"tensor_parallel_size", "rank"})

for _name, _description in _WORKER_RULES.items():
    compare = recorded_only if _name in _RECORDED_ONLY else kv_groups if _name == "kv_groups" else equality
    register(Rule(_name, _description, _worker(_name), compare))

# Every pinned fact must have its rule: a fact added to the models without one
# would be recorded but never checked.
if set(HostFacts.model_fields) != set(_HOST_RULES) or set(WorkerFacts.model_fields) != set(_WORKER_RULES):
    raise RuntimeError("ckpt.compat: the pinned facts and the rules do not correspond")


def check(recorded: Pins, current: Pins) -> list[RuleResult]:
    """Run every registered rule: ``recorded`` is the checkpoint's pins, ``current`` this side's."""
    return [rule.evaluate(recorded, current) for rule in RULES.values()]


def _names(values: Iterable[str]) -> frozenset[str]:
    # Accept "a,b" as well as ["a", "b"]: the CLI passes comma-separated lists.
    names: set[str] = set()
    for value in values:
        names.update(part.strip() for part in value.split(",") if part.strip())
    return frozenset(names)


@dataclass(frozen=True)
class Policy:
    """Which verdicts refuse a warm restore.

    The default is strict: any MISMATCH or UNKNOWN refuses. Rules in
    ``ignore`` never refuse; rules in ``allow_unknown`` accept UNKNOWN but
    still refuse on MISMATCH. Unknown rule names raise
    :class:`~ckpt.errors.ConfigError`, so a typo never silently weakens or
    strengthens a policy.
    """

    ignore: frozenset[str] = frozenset()
    allow_unknown: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        given: tuple[tuple[str, object], ...] = (
            ("ignore", self.ignore),
            ("allow_unknown", self.allow_unknown),
        )
        for what, names in given:
            # Checked at run time: a list or a bare string here is a caller's
            # mistake that would otherwise fail obscurely (or per character).
            if not isinstance(names, frozenset):
                raise ConfigError(f"compatibility policy: {what} must be a frozenset of rule names")
            bad = sorted(str(n) for n in names - RULES.keys())
            if bad:
                raise ConfigError(
                    f"compatibility policy: unknown rule name(s) in {what}: {', '.join(bad)} "
                    f"(valid: {', '.join(RULES)})"
                )

    @classmethod
    def from_strings(cls, *, ignore: Iterable[str] = (), allow_unknown: Iterable[str] = ()) -> Policy:
        """Build a policy from rule names (each item may itself be comma-separated).

        Raises :class:`~ckpt.errors.ConfigError` naming any unknown rule and
        listing the valid ones.
        """
        if isinstance(ignore, str) or isinstance(allow_unknown, str):
            # A bare string would be iterated character by character.
            ignore = [ignore] if isinstance(ignore, str) else ignore
            allow_unknown = [allow_unknown] if isinstance(allow_unknown, str) else allow_unknown
        return cls(ignore=_names(ignore), allow_unknown=_names(allow_unknown))

    def refuses(self, result: RuleResult) -> bool:
        """Whether this result, under this policy, refuses a warm restore."""
        if result.rule in self.ignore:
            return False
        if result.verdict is Verdict.MISMATCH:
            return True
        if result.verdict is Verdict.UNKNOWN:
            return result.rule not in self.allow_unknown
        return False


STRICT: Final = Policy()
"""The default policy: refuse on any mismatch or unknown."""


@dataclass(frozen=True)
class Decision:
    """The planner's answer: ``warm`` restore or not, and why.

    ``results`` holds every rule's result; ``reasons`` one line per refusing
    rule, naming it and both values (empty when ``warm``).
    """

    warm: bool
    results: list[RuleResult] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def raise_if_refused(self) -> None:
        """Raise :class:`~ckpt.errors.IncompatibleCheckpoint` with the reasons unless warm."""
        if not self.warm:
            raise IncompatibleCheckpoint("warm restore refused", list(self.reasons))


def rule_json(res: RuleResult, policy: Policy) -> dict[str, Any]:
    """One rule's result as every JSON answer gives it (``compat``, a restore plan)."""
    return {
        "rule": res.rule,
        "verdict": str(res.verdict),
        "checkpoint": res.recorded,
        "here": res.current,
        "detail": res.detail,
        "ignored": res.rule in policy.ignore,
        "refuses": policy.refuses(res),
    }


def decide(recorded: Pins, current: Pins, policy: Policy = STRICT) -> Decision:
    """Run every rule and apply ``policy``: may ``recorded`` be restored warm onto ``current``?"""
    results = check(recorded, current)
    reasons = [r.line for r in results if policy.refuses(r)]
    return Decision(warm=not reasons, results=results, reasons=reasons)
