"""Speculative decoding (vLLM's ``ngram`` method, which the CPU build runs) with gpuckpt loaded.

A worker with speculative decoding starts with gpuckpt's connector, checkpoints mid-decode and
restores: every request finishes. Its seeded request is not promised exact: rejection sampling
draws random numbers per draft token, and a restored request drafts differently (its first
step drafts nothing), so its continuation is another sample of the same distribution — the
ledger says so, naming speculative decoding, and greedy requests stay exact. A checkpoint of a
worker without speculative decoding restored onto one with it: the restore, judging the ledger on
that worker's description, marks the seeded request inexact, naming speculative decoding on this
worker.

(Greedy outputs under speculative decoding are the engine's own only up to numerics: the
verification pass computes several positions at once, and a random model's near-tied logits
can flip there, on the uninterrupted worker as well. Token equality is therefore not asserted
here; the canary, itself a greedy probe, may then refuse the restore, and such a restore is
cold, which is safe.)
"""

from __future__ import annotations

import pytest

from tests.harness.models import write_tiny_llama
from tests.harness.vllm import run_workers

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("vllm-speculative")
    model = str(write_tiny_llama(tmp / "model", seed=3))

    def at(name: str) -> dict:
        return {"model": model, "socket": str(tmp / f"{name}.sock"), "staging": str(tmp / f"stage-{name}")}

    spec = {"repo": str(tmp / "repo-spec"), "speculative_config": NGRAM}
    plain = {"repo": str(tmp / "repo-plain")}
    a = run_workers(
        {"spec": {**at("a"), **spec, "mode": "checkpoint"}, "plain": {**at("p"), **plain, "mode": "checkpoint"}},
        tmp,
        kill_after_result=True,
    )
    b = run_workers(
        {
            "spec": {
                **at("b"),
                **spec,
                "mode": "restore",
                "checkpoint": a["spec"]["checkpoint"],
                "turn1": a["spec"]["turn1"],
            },
            # the checkpoint without speculative decoding, onto a worker with it
            "onto-spec": {
                **at("c"),
                **plain,
                "speculative_config": NGRAM,
                "mode": "restore",
                "checkpoint": a["plain"]["checkpoint"],
                "turn1": a["plain"]["turn1"],
            },
        },
        tmp,
    )
    return {"a": a["spec"], "b": b["spec"], "plain": a["plain"], "onto-spec": b["onto-spec"]}


def test_the_ledger_names_speculative_decoding_for_the_seeded_request_alone(runs: dict) -> None:
    inexact = runs["a"]["ledger_inexact"]
    assert set(inexact) == {"req0", "req1", "req2", "seeded0"}
    (why,) = inexact["seeded0"]
    assert why.startswith("seeded sampling with speculative decoding (ngram)"), why
    assert all(inexact[r] == [] for r in ("req0", "req1", "req2")), inexact
    assert runs["a"]["checkpoint_stats"]["pages"] > 0
    # without speculative decoding the same request is exact (its generator is carried)
    assert runs["plain"]["ledger_inexact"]["seeded0"] == []
    assert "seeded0" in runs["plain"]["ledger_generators"]


def test_a_worker_with_speculative_decoding_restores_and_finishes_every_request(runs: dict) -> None:
    a, b = runs["a"], runs["b"]
    assert b["warm"] or all(r.startswith("canary:") for r in b["reasons"]), b["reasons"]
    assert set(b["restored"]) == set(a["reference"])
    for rid, r in b["restored"].items():
        assert len(r["full"]) == len(a["reference"][rid]), rid  # every request ran its whole budget
        # resubmitted as its prompt and the outputs it had: what the uninterrupted worker had then
        assert r["full"][: r["prompt_len"]] == a["reference"][rid][: r["prompt_len"]], rid


def test_restored_onto_speculative_decoding_the_seeded_request_is_reported_inexact(runs: dict) -> None:
    """Warm or, where the canary's greedy probe disagrees, cold (see the module's note): either
    way the plan names speculative decoding on this worker for the seeded request alone."""
    c = runs["onto-spec"]
    assert c["warm"] or all(r.startswith("canary:") for r in c["reasons"]), c["reasons"]
    named = {rid for rid, whys in c["inexact"].items() if any("speculative decoding" in w for w in whys)}
    assert named == {"seeded0"}, c["inexact"]
    (why,) = [w for w in c["inexact"]["seeded0"] if "speculative decoding" in w]
    assert why.startswith("on this worker: seeded sampling with speculative decoding (ngram)"), why
    assert len(c["restored"]["seeded0"]["full"]) == len(runs["plain"]["reference"]["seeded0"])
    # the restore onto the same arguments adds nothing the ledger did not already say
    b = runs["b"]
    assert [w for w in b["inexact"]["seeded0"] if "speculative decoding" in w] == runs["a"]["ledger_inexact"]["seeded0"]
