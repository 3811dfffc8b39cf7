"""Units of the vLLM adapter that need no engine: the ledger's judgement, shards, request states."""

from __future__ import annotations

import base64
import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from agent.engines import shards
from agent.engines.base import token_digest
from agent.engines.vllm.ledger import (
    SYNTHETIC,
    RunnerFacts,
    grammar_settings,
    inexact_reasons,
    judged_on,
    make_ledger,
    request_entry,
    resubmissions,
    speculative_method,
    speculative_reason,
)
from ckpt import Ledger

# vLLM's Python classes only: run against every supported vLLM release (make test)
pytestmark = pytest.mark.vllm_classes


def entry(**kw: Any) -> dict[str, Any]:
    e: dict[str, Any] = {
        "request_id": "cmpl-a-0-12345678",
        "client_request_id": "cmpl-a-0",
        "prompt_token_ids": [1, 2, 3],
        "output_token_ids": [4, 5],
        "num_computed_tokens": 4,
        "max_tokens": 10,
        "remaining_max_tokens": 8,
        "min_tokens": 5,
        "sampling": {"temperature": 0.0, "max_tokens": 10, "prompt_logprobs": 2},
        "structured_outputs": None,
        "cache_salt": None,
        "lora": None,
        "priority": 0,
        "arrival_time": 0.0,
    }
    e.update(kw)
    e.setdefault("inexact_reasons", inexact_reasons(e, RunnerFacts()))
    e["exact"] = not e["inexact_reasons"]
    return e


def test_penalties_are_exact_on_the_v1_runner_and_reported_elsewhere() -> None:
    e = entry(sampling={"frequency_penalty": 0.8, "presence_penalty": 0.5})
    assert inexact_reasons(e, RunnerFacts("v1", False)) == []
    (why,) = inexact_reasons(e, RunnerFacts("v2", False))
    assert "frequency_penalty, presence_penalty" in why
    assert "v2" in why
    assert "async" in inexact_reasons(e, RunnerFacts("v1", True))[0]


def test_seeded_sampling_under_speculative_decoding_is_reported_and_greedy_stays_exact() -> None:
    """Rejection sampling draws per draft token, and a restored request's drafts differ (its first
    step drafts nothing): a seeded request's continuation is another sample. Greedy requests,
    even with a seed, and unseeded ones promise no particular sample."""
    from types import SimpleNamespace

    from vllm.config import SpeculativeConfig

    spec = speculative_method(
        SimpleNamespace(speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    )
    assert spec == "ngram"
    assert speculative_method(SimpleNamespace(speculative_config=None)) is None
    seeded = entry(sampling={"temperature": 1.0, "seed": 1234})
    (why,) = inexact_reasons(seeded, RunnerFacts(speculative=spec))
    assert why.startswith("seeded sampling with speculative decoding (ngram)")
    assert inexact_reasons(seeded, RunnerFacts()) == []
    assert inexact_reasons(entry(sampling={"temperature": 0.0, "seed": 1234}), RunnerFacts(speculative=spec)) == []
    assert inexact_reasons(entry(sampling={"temperature": 0.8}), RunnerFacts(speculative=spec)) == []


def test_synthetic_acceptance_makes_every_request_inexact_greedy_too() -> None:
    """vLLM's ``rejection_sample_method="synthetic"`` (a benchmark mode) accepts drafts by a
    calibrated coin, greedy requests included: no request's continuation is the uninterrupted
    one's, and the ledger and the restoring worker both say so, naming the mode."""
    from types import SimpleNamespace

    from vllm.config import SpeculativeConfig

    sc = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=3,
        rejection_sample_method="synthetic",
        synthetic_acceptance_length=2.0,
    )
    spec = speculative_method(SimpleNamespace(speculative_config=sc))
    assert spec == "ngram" + SYNTHETIC
    greedy = entry(sampling={"temperature": 0.0, "max_tokens": 10})
    (why,) = inexact_reasons(greedy, RunnerFacts(speculative=spec))
    assert "synthetic acceptance" in why
    assert "(ngram," in why
    assert inexact_reasons(greedy, RunnerFacts(speculative="ngram")) == []
    led = make_ledger([greedy | {"client_request_id": "g"}], step=1, block_size=32)
    (g,) = judged_on(resubmissions(led), {"speculative": spec})
    assert not g.exact
    assert g.reasons == ("on this worker: " + speculative_reason(spec),)
    # a ledger written under synthetic acceptance already names the cause: no second reason
    led = make_ledger([greedy | {"client_request_id": "g", "inexact_reasons": [why]}], step=1, block_size=32)
    (again,) = judged_on(resubmissions(led), {"speculative": spec})
    assert again.reasons == (why,)


def test_an_unknown_grammar_backend_is_reported_and_parallel_choices_are_exact() -> None:
    e = entry(structured_outputs={"regex": "a+", "backend": "my-backend"})
    assert inexact_reasons(e, RunnerFacts()) == ["structured outputs: grammar backend 'my-backend' cannot be advanced"]
    # each choice is its own engine request with its own seed and generator, carried like any other
    e = entry(request_id="1_cmpl-a-0-12345678", sampling={"n": 1, "seed": 8})
    assert inexact_reasons(e, RunnerFacts()) == []


def test_resubmissions_carry_budget_constraint_and_judgement() -> None:
    led = make_ledger(
        [
            entry(structured_outputs={"json": {"type": "array"}, "backend": "xgrammar"}),
            entry(client_request_id="b", structured_outputs={"regex": "x", "backend": "odd"}),
        ],
        step=1,
        block_size=32,
    )
    a, b = resubmissions(led)
    assert a.token_ids == [1, 2, 3, 4, 5]
    assert a.sampling["max_tokens"] == 8
    assert a.sampling["min_tokens"] == 3
    assert "prompt_logprobs" not in a.sampling  # delivered with the first tokens
    assert a.sampling["structured_outputs"] == {"json": {"type": "array"}}
    assert a.exact
    assert not b.exact
    assert "odd" in b.reasons[0]


XGRAMMAR_COMPACT = {
    "backend": "xgrammar",
    "disable_any_whitespace": True,
    "disable_additional_properties": False,
    "reasoning_parser": "",
    "enable_in_reasoning": False,
}


def live_request(schema: dict[str, Any]) -> Any:
    """A live engine request with a JSON-schema constraint, as the scheduler half sees it."""
    so = SimpleNamespace(json=schema, regex=None, choice=None, grammar=None, json_object=None, _backend="xgrammar")
    sp = SimpleNamespace(structured_outputs=so, temperature=0.0, max_tokens=10, min_tokens=0, extra_args=None)
    return SimpleNamespace(
        request_id="chatcmpl-j-12345678",
        sampling_params=sp,
        output_token_ids=[4, 5],
        prompt_token_ids=[1, 2, 3],
        max_tokens=10,
        cache_salt=None,
        lora_request=None,
        priority=0,
        arrival_time=0.0,
        prompt_embeds=None,
        mm_features=None,
    )


def test_the_ledger_keeps_a_schema_as_the_text_the_engine_compiled_and_its_settings() -> None:
    """A schema's property order is the order its grammar generates: the ledger keeps the text
    vLLM compiled (its manifest's canonical JSON would sort a dict's keys, and a sorted schema
    rejects the earlier outputs), and the server's settings every grammar was compiled under."""
    schema = {"type": "object", "properties": {"words": {"type": "array"}, "kind": {"type": "string"}}}
    runner = RunnerFacts(grammar=XGRAMMAR_COMPACT)
    e = request_entry(live_request(schema), 4, runner)
    assert (
        e["structured_outputs"]["json"]
        == '{"type": "object", "properties": {"words": {"type": "array"}, "kind": {"type": "string"}}}'
    )
    assert e["structured_outputs"]["settings"] == XGRAMMAR_COMPACT
    led = make_ledger([e], step=1, block_size=32)
    # through the manifest's canonical JSON and back: the text (and so the order) survives
    back = Ledger.model_validate(json.loads(json.dumps(led.model_dump(by_alias=True), sort_keys=True)))
    (r,) = resubmissions(back)
    assert r.sampling["structured_outputs"] == {"json": e["structured_outputs"]["json"]}
    assert r.needs == {"grammar": XGRAMMAR_COMPACT, "backend": "xgrammar"}
    assert grammar_settings(SimpleNamespace(structured_outputs_config=SimpleNamespace(**XGRAMMAR_COMPACT))) == (
        XGRAMMAR_COMPACT
    )


@pytest.mark.parametrize(
    ("worker", "why"),
    [
        ({**XGRAMMAR_COMPACT, "disable_any_whitespace": False}, "disable_any_whitespace True here False"),
        ({**XGRAMMAR_COMPACT, "backend": "guidance"}, "backend 'xgrammar' is not the restoring worker's"),
        (None, "does not say its structured-output settings"),
    ],
)
def test_a_grammar_the_restoring_worker_would_compile_otherwise_is_left_to_its_client(
    worker: dict[str, Any] | None, why: str
) -> None:
    """Its continuation would run under another grammar: the request is not resubmitted, and its
    client's retry is computed anew (the same worker, or one with backend "auto", continues it)."""
    so = {"json": '{"type": "array"}', "backend": "xgrammar", "settings": XGRAMMAR_COMPACT}
    led = make_ledger([entry(structured_outputs=so), entry(client_request_id="plain")], step=1, block_size=32)
    reqs = resubmissions(led)
    assert judged_on(reqs, {"structured_outputs": XGRAMMAR_COMPACT}) == reqs
    assert judged_on(reqs, {"structured_outputs": {**XGRAMMAR_COMPACT, "backend": "auto"}}) == reqs
    left, plain = judged_on(reqs, {"structured_outputs": worker})
    assert left.left_to_client is not None, left
    assert why in left.left_to_client, left
    assert left.reasons == (f"left to its client: {left.left_to_client}",)
    assert plain == reqs[1]


def test_a_structured_entry_of_an_older_ledger_is_left_to_its_client_unless_it_has_no_outputs() -> None:
    """Written before the settings were recorded (its schema's keys sorted besides): which grammar
    the original ran under is not known, so no continuation is run under a guess; a request with
    no outputs yet starts its grammar afresh and needs nothing of the worker."""
    so = {"json": {"type": "array"}, "backend": "xgrammar"}
    led = make_ledger(
        [entry(structured_outputs=so), entry(client_request_id="fresh", output_token_ids=[], structured_outputs=so)],
        step=1,
        block_size=32,
    )
    old, fresh = judged_on(resubmissions(led), {"structured_outputs": XGRAMMAR_COMPACT})
    assert old.left_to_client == "its grammar's settings are not in the ledger (written by an older gpuckpt)"
    assert fresh.left_to_client is None
    assert fresh.needs is None


def test_heads_of_each_rank() -> None:
    assert shards.local_heads(1, 2, 8, 4) == shards.Heads(4, 4, 8)
    assert shards.local_heads(3, 4, 2, 1) == shards.Heads(1, 1, 2)  # replicas: ranks 2 and 3 hold head 1
    with pytest.raises(shards.ShardError, match="rank 0 of 2: KV tensors hold 3 heads, expected 4"):
        shards.local_heads(0, 2, 8, 3)


def test_check_cover_names_the_missing_rank() -> None:
    recs = [{"rank": 0, "kv_heads": [0, 2]}, {"rank": 1, "kv_heads": [2, 2]}]
    shards.check_cover(recs, 4, 2)
    with pytest.raises(shards.ShardError, match="rank 1's part is missing"):
        shards.check_cover(recs[:1], 4, 2)
    with pytest.raises(shards.ShardError, match="rank 1's part holds heads from 3, expected 2"):
        shards.check_cover([recs[0], {"rank": 1, "kv_heads": [3, 2]}], 4, 2)


@pytest.mark.parametrize(("tp", "total"), [(1, 4), (2, 4), (4, 4), (4, 2)])
def test_join_then_split_gives_every_rank_its_own_heads_back(tp: int, total: int) -> None:
    rng = np.random.default_rng(tp * 10 + total)
    layers, bs, c = 3, 4, 6
    full = [rng.standard_normal((layers, total, bs, c)).astype(np.float32) for _ in range(5)]  # 5 blocks
    count = max(1, total // tp)
    recs, per_rank = [], []
    for r in range(tp):
        h = shards.local_heads(r, tp, total, count)
        recs.append({"rank": r, "kv_heads": [h.start, h.count]})
        per_rank.append(
            iter(
                [
                    memoryview(np.ascontiguousarray(p[:, h.start : h.start + h.count]).view(np.uint8).reshape(-1))
                    for p in full
                ]
            )
        )
    joined = list(
        shards.join(per_rank, recs, dtype="float32", shard_shape=(layers, count, bs, c), head_axis=0, total=total)
    )
    assert [bytes(j) for j in joined] == [p.tobytes() for p in full]


def test_one_slot_per_rank_keeps_every_rank_s_bytes_where_replicas_differ() -> None:
    """TP 4 over 2 KV heads, each rank's page different (a state block shares the page): joined by
    heads, ranks 1 and 3 would be lost (replicas contribute once); joined by rank slots every
    rank's bytes are kept, and slot ``r`` is rank ``r``'s page."""
    rng = np.random.default_rng(7)
    tp, layers, bs, c = 4, 2, 4, 6
    pages = [[rng.standard_normal((layers, 1, bs, c)).astype(np.float32) for _ in range(3)] for _ in range(tp)]
    slots = [shards.rank_slot(r, tp, 1) for r in range(tp)]
    assert slots[3] == shards.Heads(3, 1, 4)
    recs = [{"rank": r, "kv_heads": [h.start, h.count]} for r, h in enumerate(slots)]
    shards.check_cover(recs, tp, tp)  # what a plan checks of such a manifest (page_heads = tp)

    def per_rank() -> list:
        return [iter([memoryview(p.view(np.uint8).reshape(-1)) for p in pages[r]]) for r in range(tp)]

    joined = list(shards.join(per_rank(), recs, dtype="float32", shard_shape=(layers, 1, bs, c), head_axis=0, total=tp))
    for b, j in enumerate(joined):
        stored = np.frombuffer(bytes(j), np.float32).reshape(layers, tp, bs, c)
        for r in range(tp):
            assert stored[:, r : r + 1].tobytes() == pages[r][b].tobytes()
    by_heads = [{"rank": r, "kv_heads": [shards.local_heads(r, tp, 2, 1).start, 1]} for r in range(tp)]
    lossy = list(
        shards.join(per_rank(), by_heads, dtype="float32", shard_shape=(layers, 1, bs, c), head_axis=0, total=2)
    )
    assert pages[1][0].tobytes() not in bytes(lossy[0])
    with pytest.raises(shards.ShardError, match="expected 1 \\(replicas\\)"):
        shards.rank_slot(0, 2, 2)


def test_join_refuses_a_rank_with_fewer_pages() -> None:
    page = memoryview(np.zeros((1, 1, 2, 2), np.float32).view(np.uint8).reshape(-1))
    recs = [{"rank": 0, "kv_heads": [0, 1]}, {"rank": 1, "kv_heads": [1, 1]}]
    with pytest.raises(shards.ShardError, match="rank 1's page file has fewer pages"):
        list(
            shards.join(
                [iter([page, page]), iter([page])],
                recs,
                dtype="float32",
                shard_shape=(1, 1, 2, 2),
                head_axis=0,
                total=2,
            )
        )


def test_worker_meta_of_every_rank_is_kept() -> None:
    pytest.importorskip("vllm")
    from agent.engines.vllm.connector import GpuckptWorkerMeta

    merged = GpuckptWorkerMeta({1: {0: {"index": "r0"}}}).aggregate(
        GpuckptWorkerMeta({1: {1: {"error": "x"}}, 2: {1: {}}})
    )
    assert isinstance(merged, GpuckptWorkerMeta)
    assert merged.done == {1: {0: {"index": "r0"}, 1: {"error": "x"}}, 2: {1: {}}}


def test_malformed_request_states_are_rejected_one_by_one() -> None:
    pytest.importorskip("vllm")
    from agent.engines.vllm.commands import check_states as _check_states

    ok, rejected = _check_states(
        {
            "good": {"generator_state": base64.b64encode(b"\x01" * 16).decode(), "prior_outputs": [1, 2]},
            "bad-b64": {"generator_state": "not base64!"},
            "bad-prior": {"prior_outputs": ["x"]},
            "not-a-dict": 3,
        }
    )
    assert set(ok) == {"good"}
    assert set(rejected) == {"bad-b64", "bad-prior", "not-a-dict"}
    assert "prior_outputs" in rejected["bad-prior"]


def test_a_corrupt_generator_state_replays_that_request_cold_and_nothing_else() -> None:
    from agent.session.restore import _annotate, _request_states

    entries = [
        entry(client_request_id="seeded", generator_state="%%%corrupt%%%", sampling={"seed": 1}),
        entry(client_request_id="pen", sampling={"frequency_penalty": 0.5}),
        entry(client_request_id="plain"),
    ]
    m = SimpleNamespace(ledger=make_ledger(entries, step=1, block_size=32))
    states, problems = _request_states(m, warm=True)  # type: ignore[arg-type]
    assert set(states) == {"pen"}
    assert states["pen"]["prior_outputs"] == [4, 5]
    # claimed by identity and tokens: the ledger id or the resubmission's, with prompt + outputs
    assert states["pen"]["ids"] == ["cmpl-pen-0", "pen"]
    assert states["pen"]["match"] == token_digest([1, 2, 3, 4, 5])
    assert list(problems) == ["seeded"]
    assert "generator state is corrupt" in problems["seeded"][0]
    reqs = {r.request_id: r for r in _annotate(resubmissions(m.ledger), problems)}
    assert not reqs["seeded"].exact
    assert reqs["pen"].exact
    assert reqs["plain"].exact
    _, cold = _request_states(m, warm=False)  # type: ignore[arg-type]
    assert "warm restore only" in cold["seeded"][0]


def test_a_restoring_worker_with_speculative_decoding_makes_seeded_requests_inexact() -> None:
    """A ledger written without speculative decoding judged its seeded request exact; a worker that
    runs it (its describe layout says which) cannot keep it so, on either model runner. Greedy and
    left requests are untouched, and a ledger that already named the cause gets no second reason."""
    led = make_ledger(
        [
            entry(client_request_id="s", sampling={"temperature": 1.0, "seed": 7, "max_tokens": 10}),
            entry(client_request_id="g", sampling={"temperature": 0.0, "seed": 7, "max_tokens": 10}),
        ],
        step=1,
        block_size=32,
    )
    reqs = resubmissions(led)
    assert all(r.exact for r in reqs)
    assert judged_on(reqs, {"speculative": None}) == reqs
    s, g = judged_on(reqs, {"speculative": "eagle3"})
    assert not s.exact
    assert s.reasons == ("on this worker: " + speculative_reason("eagle3"),)
    assert g.exact
    assert g.reasons == ()
    spec = RunnerFacts(speculative="ngram")
    written = make_ledger(
        [
            entry(
                client_request_id="s",
                sampling={"temperature": 1.0, "seed": 7, "max_tokens": 10},
                inexact_reasons=inexact_reasons(entry(sampling={"temperature": 1.0, "seed": 7}), spec),
            )
        ],
        step=1,
        block_size=32,
    )
    (again,) = judged_on(resubmissions(written), {"speculative": "ngram"})
    assert again.reasons == (speculative_reason("ngram"),)


def test_a_restoring_runner_that_cannot_give_back_earlier_outputs_makes_penalised_requests_inexact() -> None:
    """Penalties and bad words count a request's earlier outputs, which only V1 with synchronous
    scheduling puts back in the sampler's view. The ledger's writer judged by its own runner; a
    restore onto V1 with async scheduling or onto V2 (where the plan goes cold) must say the
    request is not exact, once, and leave requests without outputs or penalties alone."""
    pen = {"frequency_penalty": 0.8, "max_tokens": 10}
    led = make_ledger(
        [
            entry(client_request_id="p", sampling=pen, output_token_ids=[5, 6]),
            entry(client_request_id="fresh", sampling=pen, output_token_ids=[]),
            entry(client_request_id="g", sampling={"temperature": 0.0, "max_tokens": 10}, output_token_ids=[5]),
        ],
        step=1,
        block_size=32,
    )
    reqs = resubmissions(led)
    assert all(r.exact for r in reqs)
    assert judged_on(reqs, {"model_runner": "v1", "async_scheduling": False}) == reqs
    p, fresh, g = judged_on(reqs, {"model_runner": "v1", "async_scheduling": True})
    assert not p.exact
    (why,) = p.reasons
    assert why.startswith("on this worker: frequency_penalty count earlier outputs")
    assert why.endswith("model runner v1 with async scheduling")
    assert fresh.exact
    assert g.exact
    p2, _, _ = judged_on(reqs, {"model_runner": "v2"})
    assert p2.reasons == ("on this worker: " + inexact_reasons(entry(sampling=pen), RunnerFacts("v2"))[0],)
    # written on V2, restored onto V2: the ledger already names the cause in the same words
    v2 = RunnerFacts("v2")
    written = make_ledger(
        [
            entry(
                client_request_id="p",
                sampling=pen,
                output_token_ids=[5, 6],
                inexact_reasons=inexact_reasons(entry(sampling=pen), v2),
            )
        ],
        step=1,
        block_size=32,
    )
    (again,) = judged_on(resubmissions(written), {"model_runner": "v2"})
    assert again.reasons == tuple(inexact_reasons(entry(sampling=pen), v2))


def test_the_restore_report_names_each_request_that_is_not_an_exact_continuation() -> None:
    """``gpuckpt restore`` (text and ``--json``) says which requests are not exact and why: the
    restore's word at plan time, then the worker's after the resubmission, merged per request."""
    from agent.engines.serving import Completion
    from agent.engines.types import RestorePlan
    from agent.session.resubmit import Continuation, Restored, Resubmitted

    led = make_ledger(
        [
            entry(client_request_id="s", sampling={"temperature": 1.0, "seed": 7, "max_tokens": 10}),
            entry(client_request_id="g", sampling={"temperature": 0.0, "max_tokens": 10}),
        ],
        step=1,
        block_size=32,
    )
    s, g = judged_on(resubmissions(led), {"speculative": "ngram"})
    plan = RestorePlan(True, [], [s, g])
    assert Restored("ck", plan).to_json()["inexact"] == {"s": list(s.reasons)}
    late = "its carried state was never applied: replayed cold"
    done = Resubmitted(
        (Continuation(s, Completion("s", [1])), Continuation(g, Completion("g", [2]), (late,))),
        {"s": Completion("s", [1]), "g": Completion("g", [2])},
    )
    assert Restored("ck", plan, done).inexact() == {"s": list(s.reasons), "g": [late]}


def test_a_request_that_cannot_continue_exactly_is_computed_again_from_its_prompt() -> None:
    """A request whose earlier outputs need a state the restoring worker cannot give (a seeded one
    on a worker with speculative decoding, here) is never continued from them without it: the
    agent's resubmission computes it again from its original prompt under its own parameters and
    budget — whoever is served it gets an answer an uninterrupted worker gives — and the report
    says so. An exact one continues; one whose ledger does not say its budget is left to its
    client."""
    from agent.engines.serving import Completion
    from agent.engines.types import RECOMPUTED
    from agent.session.resubmit import resubmit

    led = make_ledger(
        [
            entry(client_request_id="s", sampling={"temperature": 1.0, "seed": 7, "max_tokens": 10, "min_tokens": 5}),
            entry(client_request_id="g", sampling={"temperature": 0.0, "max_tokens": 10}),
        ],
        step=1,
        block_size=32,
    )
    s, g = judged_on(resubmissions(led), {"speculative": "ngram"})
    assert not s.exact
    assert g.exact
    sent: list[Any] = []

    class Client:
        def submit(self, requests: Any) -> dict[str, Completion]:
            sent.extend(requests)
            return {r.request_id: Completion(r.request_id, [9] * r.sampling["max_tokens"]) for r in requests}

    done = resubmit(Client(), [s, g])  # type: ignore[arg-type]
    rs, rg = sent
    assert rs.token_ids == [1, 2, 3], "from its prompt, not prompt + earlier outputs"
    assert rs.output_token_ids == []
    assert (rs.sampling["max_tokens"], rs.sampling["min_tokens"]) == (10, 5), "its whole original budget"
    assert rs.sampling["seed"] == 7
    assert rs.reasons[-1] == RECOMPUTED
    assert rg.token_ids == [1, 2, 3, 4, 5]
    assert rg.sampling["max_tokens"] == 8
    summary = done.summaries()
    assert summary["s"]["output_tokens"] == 10, "the recomputed answer is the whole answer"
    assert RECOMPUTED in summary["s"]["reasons"]
    assert summary["g"]["output_tokens"] == 10
    # a ledger that does not say the budget: left to its client
    left = dataclasses.replace(s, budget=None).from_prompt()
    assert left.left_to_client is not None
    assert "cannot continue exactly" in left.left_to_client
