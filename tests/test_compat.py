"""Compatibility rules, the policy and the restore decision."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given

from ckpt import compat
from ckpt.compat import (
    RULES,
    STRICT,
    Decision,
    Policy,
    Rule,
    RuleResult,
    Verdict,
    check,
    decide,
    register,
)
from ckpt.errors import ConfigError, IncompatibleCheckpoint
from ckpt.pins import ABSENT, HostFacts, Pins, WorkerFacts
from tests.harness.strategies import INT_FIELDS, pins_strategy

HOST_RULES = [
    "gpu_product",
    "gpu_compute_capability",
    "gpu_count",
    "driver_version",
    "cuda_driver_version",
    "cuda_runtime_version",
    "cpu_isa",
    "cpu_arch",
    "torch_version",
]
WORKER_RULES = [
    "engine",
    "engine_version",
    "attention_backend",
    "kv_layout",
    "block_size",
    "kv_dtype",
    "num_kv_heads",
    "head_size",
    "model_runner",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "rank",
    "model",
    "model_revision",
    "model_digest",
    "tokenizer_digest",
    "prefix_hash_algo",
    "prefix_hash_seed",
    "kv_groups",
]
ALL_RULES = HOST_RULES + WORKER_RULES
STR_RULES = [r for r in ALL_RULES if r not in INT_FIELDS]
# Recorded for the record, never a reason to refuse: stored pages hold every
# KV head and are resharded into the restoring worker's TP size.
RECORDED_ONLY = ["tensor_parallel_size", "rank"]
# Facts of the node, not of the bytes, between two GPU workers (BASE is one): the node's GPU count
# and its CPU generation. cpu_isa is compared for CPU workers (test_cpu_isa_is_compared_for_cpu_workers).
NOT_COMPARED_ON_GPU = ["gpu_count", "cpu_isa"]
COMPARED_RULES = [r for r in ALL_RULES if r not in RECORDED_ONLY + NOT_COMPARED_ON_GPU]
# A missing kv_groups is one full-attention group (every checkpoint before hybrid groups), not unknown.
DEFAULTED = ["kv_groups"]

BASE: dict[str, Any] = {
    "gpu_product": "NVIDIA H100 80GB HBM3",
    "gpu_compute_capability": "9.0",
    "gpu_count": 8,
    "driver_version": "550.54.15",
    "cuda_driver_version": "12.4",
    "cuda_runtime_version": "12.1",
    "cpu_isa": "avx512+amx",
    "cpu_arch": "x86_64",
    "torch_version": "2.4.0+cu121",
    "engine": "vllm",
    "engine_version": "0.6.3",
    "attention_backend": "FLASH_ATTN",
    "kv_layout": "[num_blocks,kv_heads,block_size,hk+hv]",
    "block_size": 16,
    "kv_dtype": "bfloat16",
    "num_kv_heads": 8,
    "head_size": 128,
    "model_runner": "v2",
    "tensor_parallel_size": 8,
    "pipeline_parallel_size": 1,
    "rank": 0,
    "model": "/models/llama-3-70b",
    "model_revision": "main",
    "model_digest": "sha256:" + "a" * 64,
    "tokenizer_digest": "sha256:" + "b" * 64,
    "prefix_hash_algo": "sha256",
    "prefix_hash_seed": "0",
    "kv_groups": "g0=sliding_window:1024/40;g1=full/40",
}
OTHER: dict[str, Any] = {
    name: (value + 1 if isinstance(value, int) else value + "-other") for name, value in BASE.items()
}


def pins(**overrides: Any) -> Pins:
    facts = {**BASE, **overrides}
    return Pins(
        host=HostFacts(**{k: facts[k] for k in HOST_RULES}),
        worker=WorkerFacts(**{k: facts[k] for k in WORKER_RULES}),
    )


def result_of(rule: str, recorded: Pins, current: Pins) -> RuleResult:
    (found,) = [r for r in check(recorded, current) if r.rule == rule]
    return found


# --- the registry -----------------------------------------------------------


def test_one_rule_per_fact_named_like_the_field() -> None:
    assert list(RULES) == ALL_RULES
    assert set(HOST_RULES) == set(HostFacts.model_fields)
    assert set(WORKER_RULES) == set(WorkerFacts.model_fields)
    for name, rule in RULES.items():
        assert rule.name == name
        assert rule.description


def test_model_rule_is_documented_as_advisory() -> None:
    description = RULES["model"].description
    assert "Advisory" in description
    assert "model_digest" in description


def test_check_runs_every_rule_in_order() -> None:
    assert [r.rule for r in check(pins(), pins())] == ALL_RULES


def test_verdict_values() -> None:
    assert [v.value for v in Verdict] == ["match", "mismatch", "unknown"]
    assert str(Verdict.MISMATCH) == "mismatch"


# --- every rule: match, mismatch, unknown ---------------------------------


@pytest.mark.parametrize("rule", ALL_RULES)
def test_rule_match(rule: str) -> None:
    r = result_of(rule, pins(), pins())
    assert r.verdict is Verdict.MATCH
    assert r.recorded == r.current == BASE[rule]


@pytest.mark.parametrize("rule", COMPARED_RULES)
def test_rule_mismatch(rule: str) -> None:
    r = result_of(rule, pins(), pins(**{rule: OTHER[rule]}))
    assert r.verdict is Verdict.MISMATCH
    assert (r.recorded, r.current) == (BASE[rule], OTHER[rule])
    # Only this rule is affected.
    others = [x for x in check(pins(), pins(**{rule: OTHER[rule]})) if x.rule != rule]
    assert all(x.verdict is Verdict.MATCH for x in others)


@pytest.mark.parametrize("rule", RECORDED_ONLY)
@pytest.mark.parametrize("other", ["other", None])
def test_tensor_parallel_size_and_rank_are_recorded_not_compared(rule: str, other: str | None) -> None:
    r = result_of(rule, pins(), pins(**{rule: OTHER[rule] if other else None}))
    assert r.verdict is Verdict.MATCH
    assert "resharded" in r.detail
    assert decide(pins(), pins(**{rule: OTHER[rule]})).warm


def test_what_resharding_needs_is_compared() -> None:
    """Total KV heads and head size decide whether a page's heads mean the same; they refuse, naming both."""
    d = decide(pins(), pins(num_kv_heads=4, tensor_parallel_size=2))
    assert not d.warm
    assert d.reasons == ["num_kv_heads: mismatch (checkpoint 8, here 4)"]
    d = decide(pins(), pins(head_size=64))
    assert d.reasons == ["head_size: mismatch (checkpoint 128, here 64)"]


@pytest.mark.parametrize("rule", [r for r in COMPARED_RULES if r not in DEFAULTED])
@pytest.mark.parametrize(("recorded", "current"), [(None, "base"), ("base", None), (None, None)])
def test_rule_unknown(rule: str, recorded: str | None, current: str | None) -> None:
    old = pins(**{rule: None if recorded is None else BASE[rule]})
    new = pins(**{rule: None if current is None else BASE[rule]})
    r = result_of(rule, old, new)
    assert r.verdict is Verdict.UNKNOWN
    assert r.detail


@pytest.mark.parametrize("rule", STR_RULES)
def test_absent_on_both_sides_matches(rule: str) -> None:
    assert result_of(rule, pins(**{rule: ABSENT}), pins(**{rule: ABSENT})).verdict is Verdict.MATCH


@pytest.mark.parametrize("rule", [r for r in STR_RULES if r not in NOT_COMPARED_ON_GPU])
def test_absent_against_a_value_is_a_mismatch(rule: str) -> None:
    assert result_of(rule, pins(**{rule: ABSENT}), pins()).verdict is Verdict.MISMATCH
    assert result_of(rule, pins(), pins(**{rule: ABSENT})).verdict is Verdict.MISMATCH


def test_absent_is_not_unknown() -> None:
    assert result_of("gpu_product", pins(gpu_product=ABSENT), pins(gpu_product=None)).verdict is (Verdict.UNKNOWN)


def test_result_line() -> None:
    r = RuleResult("driver_version", Verdict.MISMATCH, "550.54.15", "560.35.03")
    assert r.line == "driver_version: mismatch (checkpoint 550.54.15, here 560.35.03)"
    assert str(r) == r.line
    u = RuleResult("gpu_count", Verdict.UNKNOWN, None, 8)
    assert u.line == "gpu_count: unknown (checkpoint unknown, here 8)"
    assert RuleResult("model_revision", Verdict.MISMATCH, "", "main").line == (
        'model_revision: mismatch (checkpoint "", here main)'
    )


def test_a_mismatch_whose_rule_says_more_says_it_in_the_reason() -> None:
    """The KV cache groups' rule names the group that differs; a plain inequality adds nothing."""
    d = decide(pins(kv_groups="g0=mamba@tp2/2;g1=full/2"), pins(kv_groups="g0=mamba/2;g1=full/2"))
    assert d.reasons == [
        "kv_groups: mismatch (checkpoint g0=mamba@tp2/2;g1=full/2, here g0=mamba/2;g1=full/2): KV cache group 0 "
        "(mamba): its state is split between ranks by the model's own state heads and restores onto the same "
        "tensor parallel size only (checkpoint 2, here 1)"
    ]
    plain = result_of("block_size", pins(block_size=16), pins(block_size=32))
    assert (plain.detail, plain.line) == ("values differ", "block_size: mismatch (checkpoint 16, here 32)")


# --- decide and the policy --------------------------------------------------


def test_identical_pins_restore_warm() -> None:
    decision = decide(pins(), pins())
    assert decision.warm
    assert decision.reasons == []
    assert len(decision.results) == len(ALL_RULES)
    decision.raise_if_refused()


def test_a_mismatch_refuses_naming_the_rule_and_both_values() -> None:
    decision = decide(pins(), pins(driver_version="560.35.03"))
    assert not decision.warm
    assert decision.reasons == ["driver_version: mismatch (checkpoint 550.54.15, here 560.35.03)"]
    with pytest.raises(IncompatibleCheckpoint) as info:
        decision.raise_if_refused()
    assert info.value.reasons == decision.reasons
    assert "warm restore refused" in str(info.value)
    assert "driver_version" in str(info.value)
    assert "550.54.15" in str(info.value)
    assert "560.35.03" in str(info.value)


def test_every_refusing_rule_is_reported() -> None:
    decision = decide(pins(), pins(gpu_product="NVIDIA A100-SXM4-80GB", block_size=32, model_digest=None))
    assert not decision.warm
    assert decision.reasons == [
        "gpu_product: mismatch (checkpoint NVIDIA H100 80GB HBM3, here NVIDIA A100-SXM4-80GB)",
        "block_size: mismatch (checkpoint 16, here 32)",
        f"model_digest: unknown (checkpoint {BASE['model_digest']}, here unknown)",
    ]


def test_strict_default_refuses_unknown() -> None:
    assert not decide(pins(model_digest=None), pins()).warm
    assert not decide(pins(), pins(model_digest=None), STRICT).warm


def test_policy_ignore_disregards_mismatch_and_unknown() -> None:
    policy = Policy(ignore=frozenset({"driver_version", "model"}))
    assert decide(pins(), pins(driver_version="560.35.03", model="/mnt/llama"), policy).warm
    assert decide(pins(driver_version=None), pins(), policy).warm
    # Other rules still refuse.
    assert not decide(pins(), pins(kv_dtype="fp8_e4m3"), policy).warm


def test_policy_allow_unknown_accepts_unknown_but_not_mismatch() -> None:
    policy = Policy.from_strings(allow_unknown=["model_revision"])
    assert decide(pins(model_revision=None), pins(), policy).warm
    assert decide(pins(), pins(model_revision=None), policy).warm
    refused = decide(pins(), pins(model_revision="v2"), policy)
    assert not refused.warm
    assert refused.reasons == ["model_revision: mismatch (checkpoint main, here v2)"]


def test_decision_keeps_all_results_even_when_ignored() -> None:
    policy = Policy(ignore=frozenset({"driver_version"}))
    decision = decide(pins(), pins(driver_version="560.35.03"), policy)
    assert decision.warm
    dv = [r for r in decision.results if r.rule == "driver_version"]
    assert dv[0].verdict is Verdict.MISMATCH


def test_from_strings_rejects_unknown_rule_names() -> None:
    with pytest.raises(ConfigError) as info:
        Policy.from_strings(ignore=["driver_version", "driver_versoin"])
    message = str(info.value)
    assert "driver_versoin" in message
    for name in ALL_RULES:
        assert name in message  # lists the valid ones
    with pytest.raises(ConfigError, match="gpu_vendor"):
        Policy.from_strings(allow_unknown=["gpu_vendor"])


def test_from_strings_accepts_comma_separated_and_bare_strings() -> None:
    policy = Policy.from_strings(ignore=["driver_version, model", " cpu_isa "], allow_unknown="rank")
    assert policy.ignore == frozenset({"driver_version", "model", "cpu_isa"})
    assert policy.allow_unknown == frozenset({"rank"})
    assert Policy.from_strings() == STRICT


def test_direct_construction_validates_names_and_types() -> None:
    with pytest.raises(ConfigError, match="bogus"):
        Policy(ignore=frozenset({"bogus"}))
    with pytest.raises(ConfigError, match="frozenset"):
        Policy(ignore=["model"])  # type: ignore[arg-type]


def test_refused_decision_raises_with_reasons_list() -> None:
    decision = Decision(warm=False, results=[], reasons=["x: mismatch (checkpoint 1, here 2)"])
    with pytest.raises(IncompatibleCheckpoint) as info:
        decision.raise_if_refused()
    assert info.value.reasons == ["x: mismatch (checkpoint 1, here 2)"]


CPU_HOST: dict[str, Any] = {
    "gpu_product": ABSENT,
    "gpu_compute_capability": ABSENT,
    "gpu_count": 0,
    "driver_version": ABSENT,
    "cuda_driver_version": ABSENT,
    "cuda_runtime_version": ABSENT,
}


def test_cpu_host_restores_onto_cpu_host_and_not_onto_gpu_host() -> None:
    assert decide(pins(**CPU_HOST), pins(**CPU_HOST)).warm
    refused = decide(pins(**CPU_HOST), pins())
    assert "cuda_runtime_version: mismatch (checkpoint absent, here 12.1)" in refused.reasons
    assert "gpu_product: mismatch (checkpoint absent, here NVIDIA H100 80GB HBM3)" in (refused.reasons)
    assert not [r for r in refused.reasons if r.startswith("gpu_count")]


def test_cpu_isa_is_compared_for_cpu_workers() -> None:
    """The CPU backend's pages depend on the ISA: a CPU worker's checkpoint never loads on another."""
    d = decide(pins(**CPU_HOST, cpu_isa="avx512"), pins(**CPU_HOST, cpu_isa="avx2"))
    assert d.reasons == ["cpu_isa: mismatch (checkpoint avx512, here avx2)"]
    # a CPU worker's checkpoint onto a GPU host: refused on the GPU facts, the ISA compared too
    d = decide(pins(**CPU_HOST, cpu_isa="avx512"), pins(cpu_isa="avx2"))
    assert "cpu_isa: mismatch (checkpoint avx512, here avx2)" in d.reasons


# --- GPU fleets: what differs between ordinary nodes refuses nothing ---------------------------

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def gpu_pins(product: str = H100, *, gpus: int, tp: int, isa: str) -> Pins:
    return pins(gpu_product=product, gpu_count=gpus, tensor_parallel_size=tp, cpu_isa=isa, rank=0)


@pytest.mark.parametrize("gpus", [(8, 1), (1, 8), (8, 4), (2, 1), (4, 2)])
@pytest.mark.parametrize("tp", [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2)])
@pytest.mark.parametrize("isa", [("avx512", "avx512"), ("avx512", "avx2"), ("avx2", "avx512+amx")])
def test_a_gpu_worker_restores_warm_across_node_shapes_tp_sizes_and_cpu_generations(
    gpus: tuple[int, int], tp: tuple[int, int], isa: tuple[str, str]
) -> None:
    """A TP=2 pod's checkpoint into a 1-GPU pod at TP=1, a worker moved from an 8-GPU node to a
    4-GPU node, a node of another CPU generation: the same GPU product, engine and model restore
    warm; the node facts are recorded with why they were not compared."""
    old = gpu_pins(gpus=gpus[0], tp=tp[0], isa=isa[0])
    new = gpu_pins(gpus=gpus[1], tp=tp[1], isa=isa[1])
    d = decide(old, new)
    assert d.warm, d.reasons
    by_rule = {r.rule: r for r in d.results}
    assert (by_rule["gpu_count"].recorded, by_rule["gpu_count"].current) == gpus
    if gpus[0] != gpus[1]:
        assert "not compared" in by_rule["gpu_count"].detail
    assert by_rule["cpu_isa"].verdict is Verdict.MATCH
    assert "GPU workers on both sides" in by_rule["cpu_isa"].detail


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        ({"gpu_product": H200}, "gpu_product"),
        ({"gpu_compute_capability": "10.0"}, "gpu_compute_capability"),
        ({"kv_dtype": "fp8_e4m3"}, "kv_dtype"),
        ({"engine_version": "0.7.0"}, "engine_version"),
        ({"model_digest": "sha256:" + "c" * 64}, "model_digest"),
        ({"tokenizer_digest": "sha256:" + "d" * 64}, "tokenizer_digest"),
        ({"kv_layout": "[other]"}, "kv_layout"),
    ],
)
def test_what_changes_a_gpu_pages_meaning_still_refuses(change: dict[str, Any], rule: str) -> None:
    d = decide(
        gpu_pins(gpus=8, tp=2, isa="avx512"),
        pins(**{**BASE, "gpu_count": 1, "tensor_parallel_size": 1, "cpu_isa": "avx2", **change}),
    )
    assert not d.warm
    assert [r.split(":")[0] for r in d.reasons] == [rule]


# --- extending the registry ---------------------------------------------------


@pytest.fixture
def own_registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, Rule]:
    registry = dict(compat.RULES)
    monkeypatch.setattr(compat, "RULES", registry)
    return registry


def test_a_registered_rule_runs_and_names_validate(own_registry: dict[str, Rule]) -> None:
    def major_only(recorded: Any, current: Any) -> tuple[Verdict, str]:
        if recorded is None or current is None:
            return Verdict.UNKNOWN, ""
        same = str(recorded).split(".")[0] == str(current).split(".")[0]
        return (Verdict.MATCH if same else Verdict.MISMATCH), "major version"

    register(
        Rule(
            "driver_major",
            "Driver major version.",
            lambda p: p.host.driver_version,
            major_only,
        )
    )
    results = check(pins(), pins(driver_version="550.90.07"))
    extra = [r for r in results if r.rule == "driver_major"]
    assert extra[0].verdict is Verdict.MATCH
    assert Policy.from_strings(ignore=["driver_major"]).ignore == {"driver_major"}
    with pytest.raises(ValueError, match="driver_major"):
        register(Rule("driver_major", "again", lambda p: None))


def test_a_rule_that_raises_is_unknown_and_refuses(own_registry: dict[str, Rule]) -> None:
    def broken(pins: Pins) -> Any:
        raise KeyError("oops")

    register(Rule("broken", "Always fails.", broken))
    decision = decide(pins(), pins())
    (r,) = [x for x in decision.results if x.rule == "broken"]
    assert r.verdict is Verdict.UNKNOWN
    assert "rule failed" in r.detail
    assert not decision.warm
    assert decide(pins(), pins(), Policy.from_strings(allow_unknown=["broken"])).warm


# --- properties ----------------------------------------------------------------


def _has_unknown(p: Pins) -> bool:
    return any(v is None for part in (p.host, p.worker) for v in part.model_dump().values())


@given(pins_strategy())
def test_pins_against_themselves(p: Pins) -> None:
    # Equal pins never mismatch; they refuse under the strict policy exactly
    # when some fact is unknown.
    results = check(p, p)
    assert all(r.verdict is not Verdict.MISMATCH for r in results)
    assert decide(p, p).warm == (not _has_unknown(p))
    lenient = Policy(allow_unknown=frozenset(RULES))
    assert decide(p, p, lenient).warm


@given(pins_strategy(), pins_strategy())
def test_reasons_are_exactly_the_refusing_rules(a: Pins, b: Pins) -> None:
    decision = decide(a, b)
    refusing = [r for r in decision.results if r.verdict is not Verdict.MATCH]
    assert decision.reasons == [r.line for r in refusing]
    assert decision.warm == (not refusing)
    assert decide(a, b, Policy(ignore=frozenset(RULES))).warm


def test_kv_groups_compare_group_by_group_and_name_the_group() -> None:
    r = result_of("kv_groups", pins(), pins(kv_groups="g0=sliding_window:512/40;g1=full/40"))
    assert r.verdict is Verdict.MISMATCH
    assert r.detail == "KV cache group 0: checkpoint sliding_window:1024/40, here sliding_window:512/40"
    r = result_of("kv_groups", pins(), pins(kv_groups="g0=sliding_window:1024/40"))
    assert r.verdict is Verdict.MISMATCH
    assert r.detail == "KV cache group 1: checkpoint full/40, here (none)"


def test_a_missing_kv_groups_is_one_full_attention_group() -> None:
    """Checkpoints from before hybrid groups (and engines that do not report them) carry one
    full-attention group: they restore warm into such a worker, and are refused by a hybrid one."""
    assert result_of("kv_groups", pins(kv_groups=None), pins(kv_groups="full")).verdict is Verdict.MATCH
    assert result_of("kv_groups", pins(kv_groups=None), pins(kv_groups=None)).verdict is Verdict.MATCH
    r = result_of("kv_groups", pins(kv_groups=None), pins())
    assert r.verdict is Verdict.MISMATCH
    assert "KV cache group 0: checkpoint full, here sliding_window:1024/40" in r.detail
