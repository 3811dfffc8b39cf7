"""Speculative decoding (vLLM's ``ngram`` method, which the CPU build runs) with gpuckpt loaded.

A worker with speculative decoding starts with gpuckpt's connector and checkpoints mid-decode;
a worker with it restores (a checkpoint of one without): every request finishes. A seeded
request is not promised exact there: rejection sampling draws random numbers per draft token,
and a restored request drafts differently (its first step drafts nothing), so its continuation
is another sample of the same distribution. The ledger says so, naming speculative decoding,
and greedy requests stay exact; the restore onto a worker with it, judging the ledger on that
worker's description, says so too ("on this worker").

(Greedy outputs under speculative decoding are the engine's own only up to numerics: the
verification pass computes several positions at once, and a random model's near-tied logits
can flip there, on the uninterrupted worker as well. Token equality is therefore not asserted
here; the canary, itself a greedy probe, may then refuse the restore, and such a restore is
cold, which is safe.)
"""

from __future__ import annotations

import pytest

from tests.harness.models import write_tiny_llama
from tests.harness.vllm import run_worker, run_workers

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
    # the checkpoint without speculative decoding, restored onto a worker with it
    b = run_worker(
        {
            **at("c"),
            **plain,
            "speculative_config": NGRAM,
            "mode": "restore",
            "checkpoint": a["plain"]["checkpoint"],
            "turn1": a["plain"]["turn1"],
        },
        tmp,
    )
    return {"a": a["spec"], "plain": a["plain"], "onto-spec": b}


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
    """Warm or, where the canary's greedy probe disagrees, cold (see the module's note): every
    request runs its whole budget, resubmitted as the prompt and outputs the uninterrupted worker
    had; the plan names speculative decoding on this worker for the seeded request alone."""
    ref, c = runs["plain"]["reference"], runs["onto-spec"]
    assert c["warm"] or all(r.startswith("canary:") for r in c["reasons"]), c["reasons"]
    assert set(c["restored"]) == set(ref)
    for rid, r in c["restored"].items():
        assert len(r["full"]) == len(ref[rid]), rid
        assert r["full"][: r["prompt_len"]] == ref[rid][: r["prompt_len"]], rid
    named = {rid for rid, whys in c["inexact"].items() if any("speculative decoding" in w for w in whys)}
    assert named == {"seeded0"}, c["inexact"]
    (why,) = [w for w in c["inexact"]["seeded0"] if "speculative decoding" in w]
    assert why.startswith("on this worker: seeded sampling with speculative decoding (ngram)"), why
